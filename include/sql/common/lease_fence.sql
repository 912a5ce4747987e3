-- First statement of every batch transaction: the lease must still be ours and unexpired.
-- FOR SHARE keeps a competing acquisition (an UPDATE of this row) waiting until the batch
-- commits, so a batch never overlaps with a new holder; parallel workers of the same run share
-- it. Also says whether the run's deadline has passed (an operator may move run_deadline_at to
-- now() to stop a run gracefully) and whether the lease is due for renewal.
SELECT run_deadline_at <= clock_timestamp()        AS past_deadline,
       expires_at - clock_timestamp() < ttl / 2    AS renew_due
  FROM pin_nightly.job_lease
 WHERE lock_key = %(lock_key)s AND token = %(token)s AND expires_at > clock_timestamp()
   FOR SHARE
