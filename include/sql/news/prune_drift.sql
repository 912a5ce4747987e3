-- Drift records past their retention (days).
DELETE FROM pin_nightly.news_drift
 WHERE recorded_at < clock_timestamp() - %(days)s * interval '1 day'
