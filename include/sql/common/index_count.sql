SELECT count(*) FROM pg_indexes
 WHERE schemaname || '.' || tablename = %(table)s AND indexdef ILIKE %(pattern)s
