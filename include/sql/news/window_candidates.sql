-- DailyWindow candidates: posts with a comment created, hidden or deleted since the cutoff
-- (a range scan of the recommended index on comments.updated_at; comments whose updated_at was
-- never set count by created_at), plus posts left locked by earlier runs, posts a batch
-- could not write since the cutoff (pin_nightly.item_error: the next run takes them again,
-- whatever its scope; the cutoff reaches back to the last completed sweep, so an error of the
-- night before is always inside it), and posts still held: their newest error recorded the
-- version the post still has, however long ago (a held post is not recorded again while it
-- keeps failing, and stays a candidate until it is written).
INSERT INTO pin_nightly.news_window_candidate (sweep_id, post_id)
SELECT %(sweep_id)s, post_id
  FROM (SELECT c.post_id FROM news.comments c WHERE c.updated_at >= %(cutoff)s
        UNION
        SELECT c.post_id FROM news.comments c
         WHERE c.updated_at IS NULL AND c.created_at >= %(cutoff)s
        UNION
        SELECT s.post_id FROM pin_nightly.news_skipped_post s
        UNION
        SELECT e.item_id FROM pin_nightly.item_error e
         WHERE e.job = %(job)s AND e.recorded_at >= %(cutoff)s
        UNION
        SELECT h.item_id
          FROM (SELECT DISTINCT ON (item_id) item_id, row_version FROM pin_nightly.item_error
                 WHERE job = %(job)s ORDER BY item_id, recorded_at DESC) h
          JOIN news.posts p ON p.id = h.item_id AND p.xmin::text = h.row_version) AS changed
ON CONFLICT DO NOTHING
