-- DailyWindow / targeted batch, statement 1: the sweep's next candidate posts after the cursor,
-- checked read-only against their visible comments; only the posts whose counter looks wrong
-- are locked with SKIP LOCKED. A candidate that is archived or gone is not eligible. Why the
-- posts whose counter matches need no lock: docs/design.md; why statement 2 recounts: apply.sql.
-- The keyset bounds are sargable (coalesce, not "IS NULL OR"): a generic plan of the
-- prepared statement still starts its index scan at the cursor. Candidates are sparse in the
-- keyset, so each is counted by its own descent of the partial comments index (LATERAL), a
-- plan that does not depend on estimates; no CTE scans are joined to each other (the planner
-- cannot estimate those and may pick nested loops, quadratic in the batch size).
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
    SELECT p.id, p.comments_count
      FROM news.posts p
     WHERE p.id IN (SELECT id FROM cand) AND p.status IS DISTINCT FROM 'Archived'
), suspect AS (
    SELECT e.id
      FROM eligible e
     CROSS JOIN LATERAL (SELECT count(*) AS n
                           FROM news.comments c
                          WHERE c.post_id = e.id AND c.status = 'Visible') v
     WHERE e.comments_count IS DISTINCT FROM v.n
), locked AS (
    SELECT p.id
      FROM news.posts p
     WHERE p.id IN (SELECT id FROM suspect) AND p.status IS DISTINCT FROM 'Archived'
     ORDER BY p.id
       FOR NO KEY UPDATE OF p SKIP LOCKED
)
SELECT (SELECT count(*) FROM cand)                           AS n_read,
       (SELECT count(*) FROM eligible)                       AS n_eligible,
       (SELECT id FROM cand ORDER BY id DESC LIMIT 1)::text  AS last_id,
       ARRAY(SELECT x.id::text FROM suspect x ORDER BY x.id) AS suspect_ids,
       ARRAY(SELECT x.id::text FROM locked x ORDER BY x.id)  AS locked_ids
