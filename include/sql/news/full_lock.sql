-- FullSweep batch, statement 1: the range's next posts after the cursor, checked read-only
-- against their visible comments, and only the posts whose counter looks wrong locked with
-- SKIP LOCKED (a post being written by the hot path right now is skipped and retried at the
-- end of the range). Statement 2 (news/apply) recounts the locked posts in a newer snapshot and
-- corrects them: every correction still comes from a count taken after its lock is held.
--
-- Why a post whose counter matches needs no lock: docs/design.md (news_comment_reconcile).
--
-- The comments are counted by one range scan of the partial index from the cursor to the
-- batch's last post (the span holds only the batch's posts and archived ones, which the check
-- drops). The check compares bigint maxima (each id has at most one row per input), not sums,
-- which would be numeric; ids are compared as uuids, never as text.
-- The keyset bounds are sargable (coalesce, not "IS NULL OR"): a generic plan of the
-- prepared statement still starts its index scan at the cursor. The check merges its two
-- inputs by UNION ALL + GROUP BY, not by a join of CTE scans (see candidate_lock.sql).
WITH cand AS (
    SELECT id, comments_count
      FROM news.posts
     WHERE id >= coalesce(%(after_id)s::uuid, '00000000-0000-0000-0000-000000000000'::uuid)
       AND (%(after_id)s::uuid IS NULL OR id <> %(after_id)s::uuid)
       AND id <= coalesce(%(upper_id)s::uuid, 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid)
       AND status IS DISTINCT FROM 'Archived'
     ORDER BY id
     LIMIT %(limit)s
), last AS (  -- no max(uuid) in PostgreSQL 16
    SELECT id FROM cand ORDER BY id DESC LIMIT 1
), counted AS (
    SELECT c.post_id, count(*) AS n
      FROM news.comments c
     WHERE c.post_id >= coalesce(%(after_id)s::uuid, '00000000-0000-0000-0000-000000000000'::uuid)
       AND c.post_id <= (SELECT id FROM last)
       AND c.status = 'Visible'
     GROUP BY c.post_id
), suspect AS (
    SELECT id
      FROM (SELECT id, TRUE AS in_batch, comments_count, 0::bigint AS n FROM cand
            UNION ALL SELECT post_id, FALSE, NULL, n FROM counted) AS x
     GROUP BY id
    HAVING bool_or(in_batch)
       AND max(comments_count) IS DISTINCT FROM max(n)
), locked AS (
    SELECT p.id
      FROM news.posts p
     WHERE p.id IN (SELECT id FROM suspect) AND p.status IS DISTINCT FROM 'Archived'
     ORDER BY p.id
       FOR NO KEY UPDATE OF p SKIP LOCKED
), batch AS (
    SELECT count(*) AS n FROM cand
)
SELECT (SELECT n FROM batch)                                 AS n_read,
       (SELECT n FROM batch)                                 AS n_eligible,
       (SELECT id::text FROM last)                           AS last_id,
       ARRAY(SELECT x.id::text FROM suspect x ORDER BY x.id) AS suspect_ids,
       ARRAY(SELECT x.id::text FROM locked x ORDER BY x.id)  AS locked_ids
