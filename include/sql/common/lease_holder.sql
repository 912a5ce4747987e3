SELECT holder, token, acquired_at, expires_at, expires_at <= clock_timestamp() AS expired
  FROM pin_nightly.job_lease
 WHERE lock_key = %(lock_key)s
