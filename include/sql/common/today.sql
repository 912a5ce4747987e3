-- The job's one clock: "today", the database's current date in UTC. Every date rule reads it
-- (a run dated in the future, a night before yesterday, a backfill, retention's horizon, the
-- partitions ahead). A test database may set pin_nightly.today to run a night "as of" that
-- date (docs/development.md, "Running a night as of a date"); a production database never
-- sets it.
coalesce(nullif(current_setting('pin_nightly.today', true), '')::date,
         (now() AT TIME ZONE 'UTC')::date)
