-- Sweeps: one pass of a job over its scope; opening, adopting, closing, abandoning.
-- Named statements: pin_nightly.db.sql("common/<name>") returns the block under
-- "-- name: <name>".

-- name: sweep_create
INSERT INTO pin_nightly.sweep (job, scope, family, resumable, run_id, owner, params, started_at)
VALUES (%(job)s, %(scope)s, %(family)s, %(resumable)s, %(run_id)s, %(owner)s, %(params)s::jsonb,
        clock_timestamp())
RETURNING sweep_id, scope, family, resumable, params, started_at

-- name: sweep_set_params
UPDATE pin_nightly.sweep SET params = params || %(params)s::jsonb WHERE sweep_id = %(sweep_id)s

-- name: sweep_find_own
-- The sweep this acquisition already opened or adopted (a re-run of the planning task).
SELECT sweep_id, scope, family, resumable, params, started_at
  FROM pin_nightly.sweep
 WHERE job = %(job)s AND scope = %(scope)s AND owner = %(owner)s AND status = 'open'
 ORDER BY sweep_id DESC
 LIMIT 1

-- name: sweep_adopt
-- Adopt the open resumable sweep of this scope left by an earlier run (time budget reached,
-- failure): the new run continues its ranges from their cursors. A scope whose new sweep
-- covers what an unfinished one left (subsumes: a DailyWindow) adopts only its own run's.
UPDATE pin_nightly.sweep
   SET run_id = %(run_id)s, owner = %(owner)s
 WHERE job = %(job)s AND scope = %(scope)s AND status = 'open' AND resumable
   AND (NOT %(subsumes)s OR run_id = %(run_id)s)
RETURNING sweep_id, scope, family, resumable, params, started_at

-- name: sweep_adopt_ranges
-- The adopting acquisition takes the ranges that are left and starts its own counters on them.
-- An acquisition of the same run (the whole run cleared, which draws a new run tag; or another
-- deployment's run of the same slot once the first let go) takes all of the run's ranges with
-- their counters, done ones included, so that the run's totals stay whole. (In SET, run_id is
-- the value before the update.)
UPDATE pin_nightly.sweep_range
   SET run_id = %(run_id)s, owner = %(owner)s,
       rows_processed = CASE WHEN run_id = %(run_id)s THEN rows_processed ELSE 0 END,
       rows_changed   = CASE WHEN run_id = %(run_id)s THEN rows_changed ELSE 0 END,
       batches        = CASE WHEN run_id = %(run_id)s THEN batches ELSE 0 END,
       skipped_locked = CASE WHEN run_id = %(run_id)s THEN skipped_locked ELSE 0 END,
       item_errors    = CASE WHEN run_id = %(run_id)s THEN item_errors ELSE 0 END,
       rows_written   = CASE WHEN run_id = %(run_id)s THEN rows_written ELSE 0 END,
       updated_at = clock_timestamp()
 WHERE sweep_id = %(sweep_id)s AND owner <> %(owner)s
   AND (status = 'pending' OR run_id = %(run_id)s)

-- name: sweep_adopt_unfinished
-- The unfinished resumable sweeps of the job other than the run's own scope (for example a
-- FullSweep stopped by its time budget, on a DailyWindow night): the run adopts them and works
-- on their ranges after its own, oldest sweep first.
UPDATE pin_nightly.sweep
   SET run_id = %(run_id)s, owner = %(owner)s
 WHERE job = %(job)s AND scope <> %(scope)s AND status = 'open' AND resumable
RETURNING sweep_id, scope, family, resumable, params, started_at

-- name: sweep_ranges
SELECT range_no, lower_id::text AS lower_id, upper_id::text AS upper_id,
       cursor_id::text AS cursor_id, planned_rows, status
  FROM pin_nightly.sweep_range
 WHERE sweep_id = %(sweep_id)s
 ORDER BY range_no

-- name: sweep_close_finished
-- Close every open sweep of the job whose ranges are all done, whoever owns it: a run whose
-- summary never ran (worker lost, retries used up) leaves such a sweep behind, and no range of
-- it is left for a later run to own. Sweeps of the acquisition in keep_owner stay open (its
-- summary closes them; a re-run of its planning task returns their done ranges unchanged).
UPDATE pin_nightly.sweep s
   SET status = 'done', completed_at = clock_timestamp()
 WHERE s.job = %(job)s AND s.status = 'open'
   AND s.owner IS DISTINCT FROM %(keep_owner)s
   AND NOT EXISTS (SELECT 1 FROM pin_nightly.sweep_range r
                    WHERE r.sweep_id = s.sweep_id AND r.status <> 'done')
RETURNING s.sweep_id, s.scope, s.run_id

-- name: sweep_abandon_family
-- A new resumable sweep makes the open sweeps of the same family and formula but another scope
-- obsolete (for example yesterday's popularity pass); a run with another formula never
-- abandons the nightly's, nor the nightly a variant's.
UPDATE pin_nightly.sweep
   SET status = 'abandoned', completed_at = clock_timestamp()
 WHERE job = %(job)s AND family = %(family)s AND scope <> %(scope)s
   AND {common/sweep_variant} = %(variant)s
   AND status = 'open' AND resumable

-- name: sweep_variant
-- A fragment: the formula part of a sweep's scope (what follows its family and date: "" for the
-- nightly's, " window 10d half-life 3d" for a run with other formula params).
coalesce(substring(scope FROM ' .*$'), '')

-- name: sweep_abandon_subsumed
-- The unfinished sweep of this scope that a new one covers (subsumes) is closed as abandoned.
UPDATE pin_nightly.sweep
   SET status = 'abandoned', completed_at = clock_timestamp()
 WHERE job = %(job)s AND scope = %(scope)s AND status = 'open' AND resumable
RETURNING sweep_id, scope, run_id

-- name: sweep_previous_ranges
-- The ranges of the family's previous sweep of the same formula, in the order they were queued, when it was
-- abandoned unfinished (a newer date's sweep superseded it after its budget ran out, a failure,
-- a graceful stop): what it left unreached goes first in the new sweep. No row when that sweep
-- finished.
SELECT prev.sweep_id, r.range_no, r.lower_id::text AS lower_id, r.upper_id::text AS upper_id,
       r.cursor_id::text AS cursor_id, r.wrap_at::text AS wrap_at, r.wrapped, r.status
  FROM (SELECT sweep_id, status FROM pin_nightly.sweep
         WHERE job = %(job)s AND family = %(family)s AND resumable AND sweep_id < %(sweep_id)s
           AND {common/sweep_variant} = %(variant)s
         ORDER BY sweep_id DESC LIMIT 1) prev
  JOIN pin_nightly.sweep_range r ON r.sweep_id = prev.sweep_id
 WHERE prev.status = 'abandoned'
 ORDER BY r.range_no

-- name: sweep_abandon_orphans
-- A sweep that no other run may adopt (a targeted repair or a dry run) and that its own run left
-- unfinished is closed as abandoned by the next run: its run said backlog_remaining, and it is
-- repeated by triggering it again, not resumed.
UPDATE pin_nightly.sweep
   SET status = 'abandoned', completed_at = clock_timestamp()
 WHERE job = %(job)s AND status = 'open' AND NOT resumable AND owner <> %(owner)s
RETURNING sweep_id, scope, run_id

-- name: sweeps_unfinished
-- Work left after a run: the open sweeps that a later run resumes (resumable), and the run's own
-- open sweeps (a targeted repair or a dry run stopped by its time budget).
SELECT sweep_id, scope, run_id, started_at
  FROM pin_nightly.sweep
 WHERE job = %(job)s AND status = 'open' AND (resumable OR owner = %(owner)s)
 ORDER BY started_at

-- name: sweeps_last_completed
-- When the newest sweep of each family completed (real runs only: no dry runs, no targeted
-- repairs, none a run failed most rows of), as unix time: the job's work is really being done,
-- not only its runs ending.
SELECT family, extract(epoch FROM max(completed_at))::float8 AS completed_at
  FROM pin_nightly.sweep
 WHERE job = %(job)s AND status = 'done' AND resumable AND {common/sweep_trusted}
 GROUP BY family

-- name: sweep_trusted
-- A sweep whose rows were written: not one a run failed most rows of (sweeps_mark_failed).
NOT pin_nightly.sweep.params ? 'rows_failed'

-- name: sweeps_mark_failed
-- The sweeps an acquisition worked, when most of the rows it tried failed: they do not count as
-- the job's work done: the freshness gauges stay where they were until a later sweep completes.
UPDATE pin_nightly.sweep s
   SET params = s.params || jsonb_build_object('rows_failed', %(status)s::text)
 WHERE s.job = %(job)s
   AND s.sweep_id IN (SELECT sweep_id FROM pin_nightly.sweep_range WHERE owner = %(owner)s)
