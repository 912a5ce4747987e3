-- When the newest sweep of each family completed (real runs only: no dry runs, no targeted
-- repairs), as unix time: the job's work is really being done, not only its runs ending.
SELECT family, extract(epoch FROM max(completed_at))::float8 AS completed_at
  FROM pin_nightly.sweep
 WHERE job = %(job)s AND status = 'done' AND resumable
 GROUP BY family
