-- Signals (metrics, alerts) of the acquisitions' summaries: pin_nightly.run_signal.
-- Named statements: pin_nightly.db.sql("common/<name>") returns the block under
-- "-- name: <name>".

-- name: signal_sent
-- What the acquisition's summary already sent (a summary task run again), or no row.
SELECT signals, work_done_at
  FROM pin_nightly.run_signal
 WHERE job = %(job)s AND owner = %(owner)s

-- name: signal_of_run
-- The signals of the run's newest earlier acquisition (a whole-run clear's summary sends what
-- that one did not), or no row.
SELECT signals
  FROM pin_nightly.run_signal
 WHERE job = %(job)s AND run_id = %(run_id)s AND owner <> %(owner)s
 ORDER BY emitted_at DESC
 LIMIT 1

-- name: signal_window
-- Where this summary counts from: the instant up to which earlier summaries counted (of any
-- run; of nightly runs); with none, the start of the oldest sweep the acquisition worked (it
-- may have resumed the work of runs that died before their summaries). The instant it counts up
-- to; when the acquisition's work completed (its last range write); whether the run is current:
-- no newer run (by the instant it is about) has sent its summary. The summary of an older run,
-- cleared after newer nights, counts nothing they did and sets no gauge of the nightly work.
WITH own AS (
    SELECT least(min(s.started_at), %(acquired_at)s::timestamptz) AS began,
           max(r.updated_at)                                     AS last_write
      FROM pin_nightly.sweep_range r JOIN pin_nightly.sweep s USING (sweep_id)
     WHERE s.job = %(job)s AND r.owner = %(owner)s
)
SELECT coalesce((SELECT max(drift_through) FROM pin_nightly.run_signal
                  WHERE job = %(job)s), own.began)                  AS since_any,
       coalesce((SELECT max(drift_through) FROM pin_nightly.run_signal
                  WHERE job = %(job)s AND nightly), own.began)      AS since_nightly,
       clock_timestamp()                                             AS through,
       coalesce(own.last_write, clock_timestamp())                   AS work_done_at,
       NOT EXISTS (SELECT 1 FROM pin_nightly.run_signal
                    WHERE job = %(job)s AND run_at > %(run_at)s)     AS current
  FROM own

-- name: signal_record
INSERT INTO pin_nightly.run_signal
       (job, owner, run_id, run_at, nightly, work_done_at, drift_through, signals)
VALUES (%(job)s, %(owner)s, %(run_id)s, %(run_at)s, %(nightly)s, %(work_done_at)s,
        %(drift_through)s, %(signals)s::jsonb)

-- name: prune_signals
-- Past the run log's retention; the newest row of each kind stays (the next summary counts
-- from it).
DELETE FROM pin_nightly.run_signal s
 WHERE s.job = %(job)s AND s.emitted_at < clock_timestamp() - %(days)s * interval '1 day'
   AND s.drift_through < (SELECT max(k.drift_through) FROM pin_nightly.run_signal k
                           WHERE k.job = %(job)s AND k.nightly = s.nightly)
