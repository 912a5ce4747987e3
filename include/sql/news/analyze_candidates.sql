-- Fresh statistics for the candidate table once a window sweep has filled it, so that the
-- batches' plans fit its size (a job role that does not own the table gets a warning only).
ANALYZE pin_nightly.news_window_candidate
