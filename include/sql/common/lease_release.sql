-- Release the lease when this run holds it, whichever token it holds it under (a task cleared
-- on its own may have taken it again after the run's teardown released it).
DELETE FROM pin_nightly.job_lease
 WHERE lock_key = %(lock_key)s AND holder = %(holder)s
RETURNING holder
