-- Snapshots older than as_of_date - (keep_days + 2) are no longer read by any score; keep_days
-- is never less than the nightly window (see catalog.retention). The horizon is never computed
-- from a date later than the database's current date (UTC).
DELETE FROM catalog.popularity_daily_views
 WHERE run_date < least(%(as_of)s::date, (now() AT TIME ZONE 'UTC')::date) - (%(keep_days)s + 2)
