-- Drift records past their retention (days) that the summaries have counted: recorded before the
-- newest nightly summary counted through (pin_nightly.run_signal; every summary counts from a
-- point no earlier), so that a correction no summary has counted yet is never lost to its
-- signals. Before the first nightly summary nothing goes.
DELETE FROM pin_nightly.news_drift
 WHERE recorded_at < clock_timestamp() - %(days)s * interval '1 day'
   AND recorded_at < (SELECT coalesce(max(drift_through), '-infinity') FROM pin_nightly.run_signal
                       WHERE job = %(job)s AND nightly)
