-- The sweep this run already opened or adopted (a re-run of the planning task).
SELECT sweep_id, scope, family, resumable, params, started_at
  FROM pin_nightly.sweep
 WHERE job = %(job)s AND scope = %(scope)s AND run_id = %(run_id)s AND status = 'open'
 ORDER BY sweep_id DESC
 LIMIT 1
