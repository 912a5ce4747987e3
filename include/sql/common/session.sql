-- Session settings and catalog probes used by every job.
-- Named statements: pin_nightly.db.sql("common/<name>") returns the block under
-- "-- name: <name>".

-- name: async_commit
-- Batch transactions commit without waiting for their WAL flush (SET LOCAL). A server crash can
-- lose the last few committed batches -- their corrections and their cursor moves together,
-- since WAL is replayed in order -- and the next run redoes them from the checkpoint it finds:
-- the recount is absolute and the snapshot upsert idempotent. A run's totals are read back from
-- the range rows, so they never count a lost batch.
SELECT set_config('synchronous_commit', 'off', true)

-- name: session_bounds
-- For the whole session: each timeout that is still off (0) gets the job's default; returns
-- every timeout's value in force.
SELECT b.name, CASE WHEN current_setting(b.name) IN ('0', '0ms')
                    THEN set_config(b.name, b.value, false)
                    ELSE current_setting(b.name) END
  FROM (VALUES ('statement_timeout', %(statement_timeout)s),
               ('lock_timeout', %(lock_timeout)s),
               ('idle_in_transaction_session_timeout',
                %(idle_in_transaction_session_timeout)s)) AS b(name, value)

-- name: wal_compression
-- For the whole session, where the job's role may set it (a superuser, or a role granted SET ON
-- PARAMETER wal_compression, PostgreSQL 15+: include/sql/schema/roles.sql) and the server
-- leaves it off: compress the full-page images of the session's writes in the WAL with the best
-- first method of %(methods)s (db.WAL_COMPRESSION) the server was built with.
-- Returns the value in force. Only on PostgreSQL 15+ (the caller checks server_version_num).
SELECT CASE WHEN current_setting('wal_compression') = 'off'
             AND has_parameter_privilege('wal_compression', 'SET')
             AND best.method IS NOT NULL
            THEN set_config('wal_compression', best.method, false)
            ELSE current_setting('wal_compression') END
  FROM (SELECT (SELECT m FROM unnest(%(methods)s::text[]) WITH ORDINALITY AS a(m, o)
                 WHERE m = ANY (enumvals) ORDER BY o LIMIT 1) AS method
          FROM pg_settings WHERE name = 'wal_compression') AS best

-- name: elapsed_ms
-- Milliseconds from an instant the database gave (a lease's acquisition) to now, both on the
-- database's clock (a worker's clock may be off by seconds).
SELECT (extract(epoch FROM clock_timestamp() - %(since)s::timestamptz) * 1000)::bigint

-- name: server_version_num
SELECT current_setting('server_version_num')::int

-- name: set_lock_timeout
-- For the rest of the transaction: give up waiting for a row lock after this many milliseconds.
SELECT set_config('lock_timeout', %(ms)s, true)

-- name: custom_plans
-- For the rest of the transaction, plan each statement for its actual parameters (SET LOCAL)
-- instead of reusing the generic plan of a prepared statement.
SELECT set_config('plan_cache_mode', 'force_custom_plan', true)

-- name: savepoint
SAVEPOINT pin_dry_run

-- name: rollback_to_savepoint
-- Dry run: undo the batch's writes, keep its row locks until the batch ends.
ROLLBACK TO SAVEPOINT pin_dry_run

-- name: relation_exists
SELECT to_regclass(%(relation)s) IS NOT NULL

-- name: table_columns
SELECT column_name FROM information_schema.columns
 WHERE table_schema = %(schema)s AND table_name = %(table)s

-- name: index_count
SELECT count(*) FROM pg_indexes
 WHERE schemaname || '.' || tablename = %(table)s AND indexdef ILIKE %(pattern)s

-- name: savepoint_item
SAVEPOINT pin_item

-- name: rollback_to_item
-- Undo the statement that failed on a row, keep the rest of the batch.
ROLLBACK TO SAVEPOINT pin_item

-- name: release_item
RELEASE SAVEPOINT pin_item

-- name: item_error_record
-- A row a batch could not write, with its row's version ({item_table}: the job's table of it) as it
-- stands after the failed write was rolled back: the row is held back until it changes.
INSERT INTO pin_nightly.item_error
       (job, run_id, sweep_id, item_kind, item_id, sqlstate, message, row_version)
SELECT %(job)s, %(run_id)s, %(sweep_id)s, %(item_kind)s, %(item_id)s::uuid, %(sqlstate)s,
       %(message)s, (SELECT t.xmin::text FROM {item_table} t WHERE t.id = %(item_id)s::uuid)

-- name: items_held
-- The rows among ids whose newest item error recorded the version their row still has: they
-- failed before and nothing changed them since (a row's xmin changes with every update).
SELECT e.item_id::text
  FROM (SELECT DISTINCT ON (item_id) item_id, row_version
          FROM pin_nightly.item_error
         WHERE job = %(job)s AND item_id = ANY(%(ids)s::uuid[])
           AND item_kind IS NOT DISTINCT FROM %(item_kind)s
         ORDER BY item_id, recorded_at DESC) e
  JOIN {item_table} t ON t.id = e.item_id AND t.xmin::text = e.row_version
 ORDER BY e.item_id
