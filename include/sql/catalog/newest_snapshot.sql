SELECT max(run_date) FROM catalog.popularity_daily_views
