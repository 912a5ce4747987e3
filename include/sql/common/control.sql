-- Controls over an open sweep (pin_nightly.controls): given from the console, read by each of
-- the sweep's ranges before each batch. Named statements.

-- name: control_read
-- What the sweep's ranges do now: paused, and the settings given in place of the run's own.
SELECT paused, settings, updated_by, updated_at
  FROM pin_nightly.sweep_control
 WHERE sweep_id = %(sweep_id)s

-- name: control_sweep
-- The sweep a control is for, locked against a concurrent control (and its job and status).
SELECT sweep_id, job, scope, status
  FROM pin_nightly.sweep
 WHERE sweep_id = %(sweep_id)s
   FOR UPDATE

-- name: control_set
-- Pause or resume (paused NULL: unchanged) and merge the settings given.
INSERT INTO pin_nightly.sweep_control (sweep_id, paused, settings, updated_by)
VALUES (%(sweep_id)s, coalesce(%(paused)s, false), %(settings)s::jsonb, %(by)s)
ON CONFLICT (sweep_id) DO UPDATE
   SET paused     = coalesce(%(paused)s, pin_nightly.sweep_control.paused),
       settings   = pin_nightly.sweep_control.settings || excluded.settings,
       updated_by = excluded.updated_by,
       updated_at = clock_timestamp()
RETURNING paused, settings, updated_by, updated_at

-- name: control_event
INSERT INTO pin_nightly.control_event (sweep_id, action, value, given_by)
VALUES (%(sweep_id)s, %(action)s, %(settings)s::jsonb, %(by)s)

-- name: control_events_of_run
-- The controls given to the sweeps a run worked, since the run's acquisition began.
SELECT e.sweep_id, e.action, e.value, e.given_by, e.given_at
  FROM pin_nightly.control_event e
 WHERE e.sweep_id IN (SELECT r.sweep_id FROM pin_nightly.sweep_range r WHERE r.run_id = %(run_id)s)
   AND e.given_at >= %(since)s::timestamptz
 ORDER BY e.given_at

-- name: range_paused
-- A pause before a batch: each signal it was for counted once, and its length.
UPDATE pin_nightly.sweep_range r
   SET paused_ms = r.paused_ms + %(ms)s,
       pauses = r.pauses || (SELECT coalesce(jsonb_object_agg(s, coalesce((r.pauses ->> s)::int, 0) + 1),
                                             '{}'::jsonb)
                               FROM unnest(%(signals)s::text[]) AS s)
 WHERE r.sweep_id = %(sweep_id)s AND r.range_no = %(range_no)s AND r.owner = %(owner)s
RETURNING r.range_no
