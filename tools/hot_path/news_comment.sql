-- The news service's hot path (pgbench script, run by tools/pgbench.py): a comment created on
-- a post, or hidden, with the post's comments_count +1 / -1 in the same transaction, so a
-- correct counter stays correct and a drifted one keeps its drift. hide_pct % of the
-- transactions hide the comment the client created last, if still visible (a client hides
-- only its own comments: the data can be put back by deleting the comments created since);
-- the others create one, on the post in row n of hot_path_row (the nhot hot posts first,
-- picked hot_pct % of the time, then nrest others). Comment ids are uuid v7, as the service's
-- (include/sql/common/uuid7_now.sql, put in by tools/pgbench.py).
\set hidden 0
BEGIN;
\if random(1, 100) <= :hide_pct
WITH h AS (UPDATE news.comments
              SET status = CASE WHEN random() < 0.5 THEN 'HiddenByModerator'
                                ELSE 'DeletedByAuthor' END,
                  updated_at = now()
            WHERE id = :mine AND status = 'Visible' RETURNING 1)
SELECT count(*) AS hidden FROM h \gset
\endif
\if :hidden
UPDATE news.posts SET comments_count = comments_count - 1 WHERE id = :mine_post;
\else
\set n CASE WHEN random(1, 100) <= :hot_pct THEN random(1, :nhot) ELSE :nhot + random(1, :nrest) END
INSERT INTO news.comments (id, post_id, status, created_at, updated_at)
SELECT {uuid7_now}, id, 'Visible', now(), now()
  FROM hot_path_row WHERE n = :n
RETURNING id AS mine, post_id AS mine_post \gset
UPDATE news.posts SET comments_count = comments_count + 1 WHERE id = :mine_post;
\endif
END;
