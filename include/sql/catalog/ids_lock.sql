-- End-of-range retry of cards skipped because locked: wait for the lock (bounded by the
-- transaction's lock_timeout).
SELECT c.id::text AS id, TRUE AS locked, c.popularity_views AS views
  FROM {cards} c
 WHERE c.id = ANY(%(ids)s::uuid[]) AND c.status IS DISTINCT FROM 'Delisted'
 ORDER BY c.id
   FOR NO KEY UPDATE OF c
