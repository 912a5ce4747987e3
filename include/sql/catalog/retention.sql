-- Snapshots older than as_of_date - (window_days + 2) are no longer read by any score.
DELETE FROM catalog.popularity_daily_views
 WHERE run_date < %(as_of)s::date - (%(window_days)s + 2)
