-- First statement of every batch transaction: the lease must still be ours and unexpired.
-- FOR SHARE keeps a competing acquisition (an UPDATE of this row) waiting until the batch
-- commits, so a batch never overlaps with a new holder; parallel workers of the same run share it.
SELECT expires_at - clock_timestamp() AS remaining, ttl
  FROM pin_nightly.job_lease
 WHERE lock_key = %(lock_key)s AND token = %(token)s AND expires_at > clock_timestamp()
   FOR SHARE
