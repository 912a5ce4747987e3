DELETE FROM pin_nightly.job_lease
 WHERE lock_key = %(lock_key)s AND token = %(token)s
RETURNING holder
