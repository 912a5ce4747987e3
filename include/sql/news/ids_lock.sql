-- End-of-range retry of posts skipped because locked: wait for the lock (bounded by the
-- transaction's lock_timeout).
SELECT p.id::text AS id, TRUE AS eligible, TRUE AS locked
  FROM news.posts p
 WHERE p.id = ANY(%(ids)s::uuid[]) AND p.status IS DISTINCT FROM 'Archived'
 ORDER BY p.id
   FOR UPDATE OF p
