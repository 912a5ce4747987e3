-- Work left after a run: the open sweeps that a later run resumes (resumable), and the run's own
-- open sweeps (a targeted repair or a dry run stopped by its time budget).
SELECT sweep_id, scope, run_id, started_at
  FROM pin_nightly.sweep
 WHERE job = %(job)s AND status = 'open' AND (resumable OR run_id = %(run_id)s)
 ORDER BY started_at
