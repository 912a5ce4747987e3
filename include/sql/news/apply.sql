-- Batch statement 2, run after statement 1 holds the row locks: its snapshot is newer than the
-- locks, so a hot-path transaction that committed before we locked is counted, and one that
-- starts now waits for our commit. Counts the visible comments of the locked posts, corrects
-- only the drifted ones (comments_count and updated_at, nothing else) and records each
-- correction. In a dry run the drift is recorded but nothing is corrected.
WITH visible AS (
    SELECT c.post_id, count(*) AS n
      FROM news.comments c
     WHERE c.post_id = ANY(%(ids)s::uuid[]) AND c.status = 'Visible'
     GROUP BY c.post_id
), drift AS (
    SELECT p.id, p.comments_count AS count_from, coalesce(v.n, 0)::integer AS count_to
      FROM news.posts p
      LEFT JOIN visible v ON v.post_id = p.id
     WHERE p.id = ANY(%(ids)s::uuid[])
       AND p.comments_count IS DISTINCT FROM coalesce(v.n, 0)
), corrected AS (
    UPDATE news.posts p
       SET comments_count = d.count_to, updated_at = clock_timestamp()
      FROM drift d
     WHERE p.id = d.id AND NOT %(dry_run)s
    RETURNING p.id
), recorded AS (
    INSERT INTO pin_nightly.news_drift (sweep_id, run_id, post_id, count_from, count_to, dry_run)
    SELECT %(sweep_id)s, %(run_id)s, d.id, d.count_from, d.count_to, %(dry_run)s
      FROM drift d
    RETURNING post_id
), unskipped AS (
    DELETE FROM pin_nightly.news_skipped_post
     WHERE post_id = ANY(%(ids)s::uuid[]) AND NOT %(dry_run)s
    RETURNING post_id
)
SELECT d.id::text AS id, d.count_from, d.count_to,
       (SELECT count(*) FROM corrected) AS n_corrected,
       (SELECT count(*) FROM recorded) AS n_recorded,
       (SELECT count(*) FROM unskipped) AS n_unskipped
  FROM drift d
 ORDER BY d.id
