-- The read-only console (pin_nightly.console): what it reads of a job's state, on a session
-- set read-only. Named statements: pin_nightly.db.sql("console/<name>") returns the block
-- under "-- name: <name>".

-- name: session
-- Every transaction of the console's session is read-only, and no statement of it runs long.
SELECT set_config('default_transaction_read_only', 'on', false),
       set_config('statement_timeout', %(statement_timeout)s, false)

-- name: schema_columns
-- The columns of the job-owned tables the role can see: the console checks those it reads.
SELECT table_name::text AS table_name, column_name::text AS column_name
  FROM information_schema.columns
 WHERE table_schema = 'pin_nightly'

-- name: open_sweeps
-- The job's open sweeps with their progress. rows_done counts a done range as its planned
-- rows and a pending one as the rows its current owner checked (capped at the plan);
-- rows_now and working_since give the current owner's rate: since it took the lease, or since
-- its run started when it no longer holds it.
SELECT s.sweep_id, s.scope, s.family, s.resumable, s.run_id, s.owner, s.started_at,
       count(r.range_no) AS ranges_total,
       count(r.range_no) FILTER (WHERE r.status = 'done') AS ranges_done,
       coalesce(sum(r.planned_rows), 0)::bigint AS planned_rows,
       coalesce(sum(CASE WHEN r.status = 'done' THEN r.planned_rows
                         ELSE least(r.rows_processed, r.planned_rows) END), 0)::bigint AS rows_done,
       coalesce(sum(r.rows_processed) FILTER (WHERE r.owner = s.owner), 0)::bigint AS rows_now,
       coalesce(sum(r.rows_changed) FILTER (WHERE r.owner = s.owner), 0)::bigint AS changed_now,
       coalesce(sum(r.item_errors), 0)::bigint AS item_errors,
       coalesce(sum(r.skipped_locked), 0)::bigint AS skipped_locked,
       max(r.updated_at) FILTER (WHERE r.owner = s.owner AND r.batches > 0) AS last_batch_at,
       coalesce(sum(r.paused_ms), 0)::bigint AS paused_ms,
       (SELECT coalesce(jsonb_object_agg(k, n), '{}'::jsonb)
          FROM (SELECT p.key AS k, sum(p.value::int) AS n
                  FROM pin_nightly.sweep_range q, jsonb_each_text(q.pauses) p
                 WHERE q.sweep_id = s.sweep_id GROUP BY p.key) x) AS pauses,
       c.paused, c.settings AS control_settings, c.updated_by AS control_by,
       c.updated_at AS control_at,
       coalesce((SELECT l.acquired_at FROM pin_nightly.job_lease l WHERE l.holder = s.owner),
                (SELECT g.started_at FROM pin_nightly.run_log g
                  WHERE g.job = s.job AND g.run_id = s.run_id),
                s.started_at) AS working_since
  FROM pin_nightly.sweep s
  LEFT JOIN pin_nightly.sweep_range r ON r.sweep_id = s.sweep_id
  LEFT JOIN pin_nightly.sweep_control c ON c.sweep_id = s.sweep_id
 WHERE s.job = %(job)s AND s.status = 'open'
 GROUP BY s.sweep_id, c.sweep_id
 ORDER BY s.sweep_id

-- name: open_ranges
SELECT r.sweep_id, r.range_no, r.lower_id::text AS lower_id, r.upper_id::text AS upper_id,
       r.cursor_id::text AS cursor_id, r.status, r.planned_rows, r.rows_processed,
       r.rows_changed, r.batches, r.skipped_locked, r.item_errors, r.wrapped, r.updated_at,
       r.pauses, r.paused_ms
  FROM pin_nightly.sweep_range r
  JOIN pin_nightly.sweep s ON s.sweep_id = r.sweep_id
 WHERE s.job = %(job)s AND s.status = 'open'
 ORDER BY r.sweep_id, r.range_no

-- name: nights
-- The job's runs of the last %(days)s days, oldest first, with what each summary logged.
SELECT run_id, status, started_at, finished_at, result
  FROM pin_nightly.run_log
 WHERE job = %(job)s AND finished_at >= clock_timestamp() - make_interval(days => %(days)s)
 ORDER BY finished_at

-- name: open_item_errors
-- Each row's latest error, while no whole pass over its keyset (news: a FullSweep; catalog:
-- the pass of its card kind) has completed since: that pass would have tried the row again.
WITH latest AS (
    SELECT DISTINCT ON (e.item_id) e.item_id::text AS item_id, e.item_kind, e.run_id,
           e.sweep_id, e.sqlstate, e.message, e.recorded_at
      FROM pin_nightly.item_error e
     WHERE e.job = %(job)s
     ORDER BY e.item_id, e.recorded_at DESC
)
SELECT l.*
  FROM latest l
 WHERE NOT EXISTS (
        SELECT 1 FROM pin_nightly.sweep s
         WHERE s.job = %(job)s AND s.status = 'done' AND s.resumable
           AND s.family = coalesce(%(whole_family)s, l.item_kind)
           AND s.started_at > l.recorded_at)
 ORDER BY l.recorded_at DESC, l.item_id
 LIMIT %(limit)s

-- name: lease
SELECT holder, acquired_at, expires_at, run_deadline_at,
       expires_at > clock_timestamp() AS live
  FROM pin_nightly.job_lease
 WHERE lock_key = %(lock_key)s
