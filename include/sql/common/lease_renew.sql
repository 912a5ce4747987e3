UPDATE pin_nightly.job_lease
   SET expires_at = greatest(expires_at, clock_timestamp() + ttl)
 WHERE lock_key = %(lock_key)s AND token = %(token)s AND expires_at > clock_timestamp()
RETURNING expires_at
