-- What a backfill run of a day is checked against before it writes.

-- name: backfill_today
-- The database's current date in UTC (the clock that dates are bounded by); stored: false.
SELECT (now() AT TIME ZONE 'UTC')::date AS today, false AS stored

-- name: backfill_snapshots
-- The same, and whether that day already has snapshots (a re-run of a stored date) or a newer
-- day has (the run writes nothing anyway).
SELECT (now() AT TIME ZONE 'UTC')::date AS today,
       EXISTS (SELECT 1 FROM catalog.popularity_daily_views
                WHERE run_date >= %(day)s::date) AS stored
