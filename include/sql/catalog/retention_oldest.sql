-- The oldest night past retention's horizon (see retention.sql), NULL when there is none:
-- retention deletes it even when the run's deadline has passed.
SELECT min(run_date) FROM catalog.popularity_daily_views
 WHERE run_date < least(%(as_of)s::date, (now() AT TIME ZONE 'UTC')::date) - (%(keep_days)s + 2)
