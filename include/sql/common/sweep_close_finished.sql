-- Close every open sweep of the job whose ranges are all done, whoever owns it: a run whose
-- summary never ran (worker lost, retries used up) leaves such a sweep behind, and no range of
-- it is left for a later run to own. Sweeps of the run in keep_run_id stay open (its summary
-- closes them; a re-run of its planning task returns their done ranges unchanged).
UPDATE pin_nightly.sweep s
   SET status = 'done', completed_at = clock_timestamp()
 WHERE s.job = %(job)s AND s.status = 'open'
   AND s.run_id IS DISTINCT FROM %(keep_run_id)s
   AND NOT EXISTS (SELECT 1 FROM pin_nightly.sweep_range r
                    WHERE r.sweep_id = s.sweep_id AND r.status <> 'done')
RETURNING s.sweep_id, s.scope, s.run_id
