-- Keyset ranges of a sweep: planning boundaries, the cursor (checkpoint) and the totals.
-- Named statements: pin_nightly.db.sql("common/<name>") returns the block under
-- "-- name: <name>".

-- name: keyset_count
-- The source is a keyset source query from include/sql, never from input.
SELECT count(*) FROM ({source}) AS src

-- name: keyset_next_boundary
-- The id %(pin_skip)s rows past the previous boundary in keyset order (the first: from the
-- start): the next inner boundary of equal-sized ranges. An index scan that stops there, so
-- all boundaries together read the keyset about once, without numbering every row.
-- The source is a keyset source query from include/sql, never from input.
-- Ordered by src.id, the uuid: a bare "id" would name the text output column.
SELECT src.id::text AS boundary
  FROM ({source}) AS src
 WHERE src.id >= coalesce(%(pin_after)s::uuid, '00000000-0000-0000-0000-000000000000'::uuid)
   AND (%(pin_after)s::uuid IS NULL OR src.id <> %(pin_after)s::uuid)
 ORDER BY src.id
OFFSET %(pin_skip)s
 LIMIT 1

-- name: range_insert
INSERT INTO pin_nightly.sweep_range
       (sweep_id, range_no, lower_id, upper_id, wrap_at, planned_rows, run_id, owner)
VALUES (%(sweep_id)s, %(range_no)s, %(lower_id)s::uuid, %(upper_id)s::uuid, %(wrap_at)s::uuid,
        %(planned_rows)s, %(run_id)s, %(owner)s)

-- name: range_get
-- A range, its owner and its sweep's state; superseded_by names the run that took the work
-- over: the adopter of the range, or the run of the newest later sweep of the same family.
SELECT r.range_no, r.lower_id::text AS lower_id, r.upper_id::text AS upper_id,
       r.cursor_id::text AS cursor_id, r.wrap_at::text AS wrap_at, r.wrapped,
       r.status, r.run_id, r.owner, s.status AS sweep_status,
       CASE WHEN s.status = 'open' OR n.run_id IS NULL THEN r.run_id
            ELSE n.run_id || coalesce(' of ' || (n.params ->> 'as_of_date'), '')
       END AS superseded_by
  FROM pin_nightly.sweep_range r
  JOIN pin_nightly.sweep s USING (sweep_id)
  LEFT JOIN LATERAL (SELECT n.run_id, n.params FROM pin_nightly.sweep n
                      WHERE n.job = s.job AND n.family = s.family AND n.sweep_id > s.sweep_id
                        AND n.resumable
                      ORDER BY n.sweep_id DESC LIMIT 1) n ON true
 WHERE r.sweep_id = %(sweep_id)s AND r.range_no = %(range_no)s

-- name: range_advance
-- Checkpoint: advance the range cursor in the batch's own transaction, only while the range
-- is the acquisition's and its sweep open (no row: the work was taken over, the batch rolls
-- back).
UPDATE pin_nightly.sweep_range
   SET cursor_id      = coalesce(%(cursor_id)s::uuid, cursor_id),
       rows_processed = rows_processed + %(processed)s,
       rows_changed   = rows_changed + %(changed)s,
       batches        = batches + 1,
       skipped_locked = skipped_locked + %(skipped_locked)s,
       item_errors    = item_errors + %(item_errors)s,
       rows_written   = rows_written + %(written)s,
       updated_at     = clock_timestamp()
 WHERE sweep_id = %(sweep_id)s AND range_no = %(range_no)s AND status = 'pending'
   AND owner = %(owner)s
   AND EXISTS (SELECT 1 FROM pin_nightly.sweep s
                WHERE s.sweep_id = %(sweep_id)s AND s.status = 'open')
RETURNING cursor_id::text

-- name: range_retried
-- What a row taken on its own adds (pin_nightly.ranges.Counters): one the end-of-range retry
-- took is no longer counted as skipped (skipped_locked < 0); one remembered, taken first.
UPDATE pin_nightly.sweep_range
   SET rows_processed = rows_processed + %(processed)s,
       rows_changed   = rows_changed + %(changed)s,
       skipped_locked = skipped_locked + %(skipped_locked)s,
       rows_written   = rows_written + %(written)s,
       item_errors    = item_errors + %(item_errors)s,
       updated_at     = clock_timestamp()
 WHERE sweep_id = %(sweep_id)s AND range_no = %(range_no)s AND owner = %(owner)s
   AND EXISTS (SELECT 1 FROM pin_nightly.sweep s
                WHERE s.sweep_id = %(sweep_id)s AND s.status = 'open')
RETURNING range_no

-- name: range_wrap
-- A range that started at wrap_at reached its upper end: it goes on from its lower end.
UPDATE pin_nightly.sweep_range
   SET wrapped = true, cursor_id = lower_id, updated_at = clock_timestamp()
 WHERE sweep_id = %(sweep_id)s AND range_no = %(range_no)s AND owner = %(owner)s
   AND status = 'pending'
RETURNING range_no

-- name: range_done
UPDATE pin_nightly.sweep_range
   SET status = 'done', updated_at = clock_timestamp()
 WHERE sweep_id = %(sweep_id)s AND range_no = %(range_no)s AND owner = %(owner)s
RETURNING range_no

-- name: run_totals
-- What the run did, from the counters of its ranges (named as the fields of
-- pin_nightly.ranges.Counters): every acquisition of the run (a whole-run clear's takes the
-- run's ranges with their counters; a range another run adopted is counted by that one).
SELECT r.sweep_id, s.scope, s.family, s.status AS sweep_status, s.started_at,
       count(*)                                   AS ranges,
       count(*) FILTER (WHERE r.status = 'done')  AS ranges_done,
       coalesce(sum(r.rows_processed), 0)::bigint AS processed,
       coalesce(sum(r.rows_changed), 0)::bigint   AS changed,
       coalesce(sum(r.batches), 0)::bigint        AS batches,
       coalesce(sum(r.skipped_locked), 0)::bigint AS skipped_locked,
       coalesce(sum(r.item_errors), 0)::bigint    AS item_errors,
       coalesce(sum(r.rows_written), 0)::bigint   AS written,
       max(r.cursor_id::text)                     AS last_id
  FROM pin_nightly.sweep_range r JOIN pin_nightly.sweep s USING (sweep_id)
 WHERE s.job = %(job)s AND r.run_id = %(run_id)s
 GROUP BY r.sweep_id, s.scope, s.family, s.status, s.started_at
 ORDER BY r.sweep_id

-- name: run_log_upsert
-- The run id is the key, and another deployment that fired the same slot has the same one: a
-- run that found the lease held (lock_held) never replaces the row of a run that worked.
INSERT INTO pin_nightly.run_log (job, run_id, status, result, started_at, finished_at)
VALUES (%(job)s, %(run_id)s, %(status)s, %(result)s::jsonb, %(started_at)s, clock_timestamp())
ON CONFLICT (job, run_id) DO UPDATE
   SET status = excluded.status, result = excluded.result,
       started_at = coalesce(excluded.started_at, pin_nightly.run_log.started_at),
       finished_at = excluded.finished_at
 WHERE NOT %(lock_held)s OR pin_nightly.run_log.status = %(status)s

-- name: run_log_status
-- The status a run's summary logged last (no row: none yet).
SELECT status FROM pin_nightly.run_log WHERE job = %(job)s AND run_id = %(run_id)s

-- Job-owned history past its retention (days), deleted by the runs themselves.
-- name: prune_run_log
DELETE FROM pin_nightly.run_log
 WHERE job = %(job)s AND finished_at < clock_timestamp() - %(days)s * interval '1 day'

-- name: prune_sweeps
-- Closed sweeps (with their ranges, ON DELETE CASCADE) whose work ended before the horizon;
-- whatever its age, the newest completed real sweep of each family stays (it dates what the
-- job has covered: the DailyWindow cutoff, the last-completed metrics), and so does the newest
-- real sweep of each family (a new sweep starts with what it left unreached).
DELETE FROM pin_nightly.sweep s
 WHERE s.job = %(job)s AND s.status <> 'open'
   AND s.completed_at < clock_timestamp() - %(days)s * interval '1 day'
   AND s.sweep_id NOT IN (SELECT max(k.sweep_id) FROM pin_nightly.sweep k
                           WHERE k.job = %(job)s AND k.status = 'done' AND k.resumable
                           GROUP BY k.family
                          UNION ALL
                          SELECT max(k.sweep_id) FROM pin_nightly.sweep k
                           WHERE k.job = %(job)s AND k.resumable
                           GROUP BY k.family)

-- name: prune_item_errors
DELETE FROM pin_nightly.item_error
 WHERE job = %(job)s AND recorded_at < clock_timestamp() - %(days)s * interval '1 day'
