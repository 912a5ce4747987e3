-- Take the lease when it is free, expired, or already ours (a cleared and re-run setup task).
-- Every acquisition gets a new fencing token. Minutes may be fractional (the params are numbers;
-- make_interval(mins => ...) takes integers only).
INSERT INTO pin_nightly.job_lease AS l
       (lock_key, holder, token, ttl, acquired_at, expires_at, run_deadline_at)
VALUES (%(lock_key)s, %(holder)s, nextval('pin_nightly.lease_token_seq'),
        %(ttl_minutes)s::float8 * interval '1 minute', clock_timestamp(),
        clock_timestamp() + %(ttl_minutes)s::float8 * interval '1 minute',
        clock_timestamp() + %(max_run_minutes)s::float8 * interval '1 minute')
ON CONFLICT (lock_key) DO UPDATE
   SET holder = excluded.holder, token = excluded.token, ttl = excluded.ttl,
       acquired_at = excluded.acquired_at, expires_at = excluded.expires_at,
       run_deadline_at = excluded.run_deadline_at
 WHERE l.expires_at <= clock_timestamp() OR l.holder = excluded.holder
RETURNING token, acquired_at, expires_at, run_deadline_at
