-- Snapshots older than as_of_date - (keep_days + 2) are no longer read by any score; keep_days
-- is never less than the nightly window (see catalog.retention).
DELETE FROM catalog.popularity_daily_views
 WHERE run_date < %(as_of)s::date - (%(keep_days)s + 2)
