-- Take the lease when it is free, expired, or already this holder's. Every acquisition gets a
-- new fencing token, except a rejoin (keep_live): a task whose run already holds the lease again
-- (a sibling task rejoined first) keeps it as it is, token included, so that siblings working in
-- parallel are not fenced out. When another holder has an unexpired lease nothing changes and
-- no row is returned. Minutes may be fractional (the params are numbers; make_interval(mins =>
-- ...) takes integers only).
INSERT INTO pin_nightly.job_lease AS l
       (lock_key, holder, token, ttl, acquired_at, expires_at, run_deadline_at)
VALUES (%(lock_key)s, %(holder)s, nextval('pin_nightly.lease_token_seq'),
        %(ttl_minutes)s::float8 * interval '1 minute', clock_timestamp(),
        clock_timestamp() + %(ttl_minutes)s::float8 * interval '1 minute',
        clock_timestamp() + %(max_run_minutes)s::float8 * interval '1 minute')
ON CONFLICT (lock_key) DO UPDATE
   SET holder = excluded.holder,
       token = CASE WHEN %(keep_live)s AND l.expires_at > clock_timestamp() THEN l.token
                    ELSE excluded.token END,
       ttl = CASE WHEN %(keep_live)s AND l.expires_at > clock_timestamp() THEN l.ttl
                  ELSE excluded.ttl END,
       acquired_at = CASE WHEN %(keep_live)s AND l.expires_at > clock_timestamp()
                          THEN l.acquired_at ELSE excluded.acquired_at END,
       expires_at = CASE WHEN %(keep_live)s AND l.expires_at > clock_timestamp()
                         THEN l.expires_at ELSE excluded.expires_at END,
       run_deadline_at = CASE WHEN %(keep_live)s AND l.expires_at > clock_timestamp()
                              THEN l.run_deadline_at ELSE excluded.run_deadline_at END
 WHERE l.expires_at <= clock_timestamp() OR l.holder = excluded.holder
RETURNING token, acquired_at, expires_at, run_deadline_at
