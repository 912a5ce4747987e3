-- A new resumable sweep makes the open sweeps of the same family but another scope obsolete
-- (for example yesterday's popularity pass).
UPDATE pin_nightly.sweep
   SET status = 'abandoned', completed_at = clock_timestamp()
 WHERE job = %(job)s AND family = %(family)s AND scope <> %(scope)s
   AND status = 'open' AND resumable
