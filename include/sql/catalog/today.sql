-- The database's current date in UTC: no run may be dated after it.
SELECT (now() AT TIME ZONE 'UTC')::date
