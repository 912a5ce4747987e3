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
SELECT c.id::text AS id, e.id IS NOT NULL AS eligible, l.id IS NOT NULL AS locked
  FROM cand c LEFT JOIN eligible e ON e.id = c.id LEFT JOIN locked l ON l.id = c.id
 ORDER BY c.id
