-- The unfinished resumable sweeps of the job other than the run's own scope (for example a
-- FullSweep stopped by its time budget, on a DailyWindow night): the run adopts them and works
-- on their ranges after its own, oldest sweep first.
UPDATE pin_nightly.sweep
   SET run_id = %(run_id)s
 WHERE job = %(job)s AND scope <> %(scope)s AND status = 'open' AND resumable
RETURNING sweep_id, scope, family, resumable, params, started_at
