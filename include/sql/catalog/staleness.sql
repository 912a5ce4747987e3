-- Hours since the newest snapshot was written: how old the freshest scores are.
SELECT extract(epoch FROM clock_timestamp() - max(created_at)) / 3600.0
  FROM catalog.popularity_daily_views
 WHERE run_date = (SELECT max(run_date) FROM catalog.popularity_daily_views)
