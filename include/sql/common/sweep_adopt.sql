-- Adopt the open resumable sweep of this scope left by an earlier run (time budget reached,
-- failure): the new run continues its ranges from their cursors.
UPDATE pin_nightly.sweep
   SET run_id = %(run_id)s
 WHERE job = %(job)s AND scope = %(scope)s AND status = 'open' AND resumable
RETURNING sweep_id, scope, family, resumable, params, started_at
