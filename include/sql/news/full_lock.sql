-- FullSweep batch, statement 1: the range's next posts after the cursor, locked with
-- SKIP LOCKED. Returns every candidate, with whether we got its lock (a post being written by
-- the hot path right now is skipped and retried at the end of the range).
-- The keyset bounds are sargable (coalesce, not "IS NULL OR"): a generic plan of the
-- prepared statement still starts its index scan at the cursor.
WITH cand AS (
    SELECT id
      FROM news.posts
     WHERE id >= coalesce(%(after_id)s::uuid, '00000000-0000-0000-0000-000000000000'::uuid)
       AND (%(after_id)s::uuid IS NULL OR id <> %(after_id)s::uuid)
       AND id <= coalesce(%(upper_id)s::uuid, 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid)
       AND status IS DISTINCT FROM 'Archived'
     ORDER BY id
     LIMIT %(limit)s
), locked AS (
    SELECT p.id
      FROM news.posts p
     WHERE p.id IN (SELECT id FROM cand) AND p.status IS DISTINCT FROM 'Archived'
     ORDER BY p.id
       FOR UPDATE OF p SKIP LOCKED
)
-- Flags by UNION ALL + GROUP BY rather than a join of CTE scans (see candidate_lock.sql).
SELECT id::text AS id, TRUE AS eligible, bool_or(is_locked) AS locked
  FROM (SELECT id, FALSE AS is_locked FROM cand
        UNION ALL SELECT id, TRUE FROM locked) AS flags
 GROUP BY id
 ORDER BY id
