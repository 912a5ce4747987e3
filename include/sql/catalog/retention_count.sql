SELECT count(*) FROM catalog.popularity_daily_views
 WHERE run_date < least(%(as_of)s::date, (now() AT TIME ZONE 'UTC')::date) - (%(keep_days)s + 2)
