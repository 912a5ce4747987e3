SELECT count(*) FROM catalog.popularity_daily_views
 WHERE run_date < %(as_of)s::date - (%(keep_days)s + 2)
