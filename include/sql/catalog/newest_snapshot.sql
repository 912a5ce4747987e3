-- What a run's as_of_date is checked against before it writes: the newest stored snapshot, the
-- newest date a real run (not dry, not targeted) opened a pass for, and the database's current
-- date in UTC (the clock that dates are bounded by).
SELECT (SELECT max(run_date) FROM catalog.popularity_daily_views) AS newest_snapshot,
       (SELECT max((params ->> 'as_of_date')::date) FROM pin_nightly.sweep
         WHERE job = %(job)s AND resumable) AS newest_pass,
       (SELECT run_id FROM pin_nightly.sweep
         WHERE job = %(job)s AND resumable
         ORDER BY (params ->> 'as_of_date')::date DESC, sweep_id DESC LIMIT 1) AS newest_pass_run,
       {common/today} AS today
