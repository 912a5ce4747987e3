-- A sweep that no other run may adopt (a targeted repair or a dry run) and that its own run left
-- unfinished is closed as abandoned by the next run: its run said backlog_remaining, and it is
-- repeated by triggering it again, not resumed.
UPDATE pin_nightly.sweep
   SET status = 'abandoned', completed_at = clock_timestamp()
 WHERE job = %(job)s AND status = 'open' AND NOT resumable AND run_id <> %(run_id)s
RETURNING sweep_id, scope, run_id
