-- The job lease: single flight across runs and deployments, with fencing tokens.
-- Named statements: pin_nightly.db.sql("common/<name>") returns the block under
-- "-- name: <name>".

-- name: lease_acquire
-- Take the lease when it is free, expired, or already this holder's. A new acquisition gets a
-- new fencing token; a holder whose lease is still live (the setup task re-run, a range's rejoin)
-- keeps it as it is, token and deadline included, so that siblings working in parallel are not
-- fenced out and the run's budget does not start again. When another holder has an unexpired
-- lease nothing changes and no row is returned. Minutes may be fractional (the params are
-- numbers; make_interval(mins => ...) takes integers only).
INSERT INTO pin_nightly.job_lease AS l
       (lock_key, holder, token, ttl, acquired_at, expires_at, run_deadline_at)
VALUES (%(lock_key)s, %(holder)s, nextval('pin_nightly.lease_token_seq'),
        %(ttl_minutes)s::float8 * interval '1 minute', clock_timestamp(),
        clock_timestamp() + %(ttl_minutes)s::float8 * interval '1 minute',
        clock_timestamp() + %(max_run_minutes)s::float8 * interval '1 minute')
ON CONFLICT (lock_key) DO UPDATE
   SET holder = excluded.holder,
       token = CASE WHEN l.expires_at > clock_timestamp() THEN l.token
                    ELSE excluded.token END,
       ttl = CASE WHEN l.expires_at > clock_timestamp() THEN l.ttl
                  ELSE excluded.ttl END,
       acquired_at = CASE WHEN l.expires_at > clock_timestamp()
                          THEN l.acquired_at ELSE excluded.acquired_at END,
       expires_at = CASE WHEN l.expires_at > clock_timestamp()
                         THEN l.expires_at ELSE excluded.expires_at END,
       run_deadline_at = CASE WHEN l.expires_at > clock_timestamp()
                              THEN l.run_deadline_at ELSE excluded.run_deadline_at END
 WHERE l.expires_at <= clock_timestamp() OR l.holder = excluded.holder
RETURNING token, acquired_at, expires_at, run_deadline_at

-- name: lease_live
-- The lease as it is while this holder has it live: taken again by the same run (its setup
-- task re-run, a range task's rejoin) it is read, not written. An UPDATE of the row would wait
-- for the batches of the siblings, which hold it FOR SHARE, and queue their next fences behind
-- it until then.
SELECT token, acquired_at, run_deadline_at
  FROM pin_nightly.job_lease
 WHERE lock_key = %(lock_key)s AND holder = %(holder)s AND expires_at > clock_timestamp()

-- name: lease_fence
-- First statement of every batch transaction: the lease must still be ours and unexpired.
-- FOR SHARE keeps a competing acquisition (an UPDATE of this row) waiting until the batch
-- commits, so a batch never overlaps with a new holder; parallel workers of the same run share
-- it. Also says whether the run's deadline has passed (an operator may move run_deadline_at to
-- now() to stop a run gracefully), or the worker's share of the run's budget (budget_share, a
-- fraction: a pass that must leave time to the passes after it), and whether the lease is due
-- for renewal.
SELECT {common/share_deadline} <= clock_timestamp() AS past_deadline,
       expires_at - clock_timestamp() < ttl / 2     AS renew_due
  FROM pin_nightly.job_lease
 WHERE lock_key = %(lock_key)s AND token = %(token)s AND expires_at > clock_timestamp()
   FOR SHARE

-- name: share_deadline
-- A fragment (of lease_fence and health/signals, on a pin_nightly.job_lease row): when a worker
-- given budget_share of the run's budget (a fraction) starts no new batch: the run's deadline,
-- or that share of the time from the acquisition to it, whichever comes first.
least(run_deadline_at, acquired_at + (run_deadline_at - acquired_at) * %(budget_share)s::float8)

-- name: lease_renew
UPDATE pin_nightly.job_lease
   SET expires_at = greatest(expires_at, clock_timestamp() + ttl)
 WHERE lock_key = %(lock_key)s AND token = %(token)s AND expires_at > clock_timestamp()
RETURNING expires_at

-- name: lease_release
-- Release the lease when this run holds it, whichever token it holds it under (a task cleared
-- on its own may have taken it again after the run's teardown released it).
DELETE FROM pin_nightly.job_lease
 WHERE lock_key = %(lock_key)s AND holder = %(holder)s
RETURNING holder

-- name: lease_holder
SELECT holder, token, acquired_at, expires_at, expires_at <= clock_timestamp() AS expired
  FROM pin_nightly.job_lease
 WHERE lock_key = %(lock_key)s
