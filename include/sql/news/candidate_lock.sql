-- DailyWindow / targeted batch, statement 1: the sweep's next candidate posts after the cursor,
-- locked with SKIP LOCKED. A candidate that is archived or gone is not eligible.
-- The keyset bounds are sargable (coalesce, not "IS NULL OR"): a generic plan of the
-- prepared statement still starts its index scan at the cursor.
WITH cand AS (
    SELECT post_id AS id
      FROM pin_nightly.news_window_candidate
     WHERE sweep_id = %(sweep_id)s
       AND post_id >= coalesce(%(after_id)s::uuid, '00000000-0000-0000-0000-000000000000'::uuid)
       AND (%(after_id)s::uuid IS NULL OR post_id <> %(after_id)s::uuid)
       AND post_id <= coalesce(%(upper_id)s::uuid, 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid)
     ORDER BY post_id
     LIMIT %(limit)s
), eligible AS (
    SELECT p.id
      FROM news.posts p
     WHERE p.id IN (SELECT id FROM cand) AND p.status IS DISTINCT FROM 'Archived'
), locked AS (
    SELECT p.id
      FROM news.posts p
     WHERE p.id IN (SELECT id FROM eligible) AND p.status IS DISTINCT FROM 'Archived'
     ORDER BY p.id
       FOR UPDATE OF p SKIP LOCKED
)
-- Flags by UNION ALL + GROUP BY rather than joins of CTE scans: the planner cannot estimate
-- those and may pick nested loops, quadratic in the batch size.
SELECT id::text AS id, bool_or(is_eligible) AS eligible, bool_or(is_locked) AS locked
  FROM (SELECT id, FALSE AS is_eligible, FALSE AS is_locked FROM cand
        UNION ALL SELECT id, TRUE, FALSE FROM eligible
        UNION ALL SELECT id, TRUE, TRUE FROM locked) AS flags
 GROUP BY id
 ORDER BY id
