-- Start of the newest completed non-targeted sweep (FullSweep or DailyWindow): every comment
-- change before it has been reconciled, so a new window needs to reach back only to it.
SELECT max(started_at) AS covered_until
  FROM pin_nightly.sweep
 WHERE job = %(job)s AND status = 'done' AND resumable
