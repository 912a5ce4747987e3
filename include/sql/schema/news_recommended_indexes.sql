-- Optional migration recommended for news_comment_reconcile. The job is correct without these
-- indexes; with them the per-batch count and the DailyWindow candidate scan use index scans.
-- On a live database run each statement on its own (CONCURRENTLY cannot run in a transaction).
CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_comments_post_id_visible
    ON news.comments (post_id) WHERE status = 'Visible';
CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_comments_updated_at
    ON news.comments (updated_at);
