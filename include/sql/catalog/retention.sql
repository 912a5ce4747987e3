-- One batch of retention: up to %(limit)s snapshots older than as_of_date - (keep_days + 2),
-- which no score reads any more (keep_days is never less than the nightly window, see
-- catalog.retention), oldest nights first through ix_popularity_daily_run_date. The horizon is
-- never computed from a date later than the database's current date (UTC).
-- The rows are deleted by their physical address (a TID scan), which the statement reads and
-- uses under one snapshot: no primary-key lookup per row (ten times faster per batch). A row
-- updated meanwhile by someone else has a new address and is left for the next night.
-- through (a date, or NULL): only snapshots up to that night (past the run's deadline,
-- retention still deletes the oldest night past the horizon, so the table never grows without
-- bound on nights whose passes use the whole budget).
DELETE FROM catalog.popularity_daily_views
 WHERE ctid = ANY (ARRAY(
       SELECT ctid FROM catalog.popularity_daily_views
        WHERE run_date < least(%(as_of)s::date, (now() AT TIME ZONE 'UTC')::date) - (%(keep_days)s + 2)
          AND run_date <= coalesce(%(through)s::date, 'infinity'::date)
        ORDER BY run_date
        LIMIT %(limit)s))
