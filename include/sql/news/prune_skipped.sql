-- A post skipped because locked is remembered until a sweep that covers it completes: a
-- completed FullSweep or DailyWindow (done, resumable) that started after the post was
-- skipped has taken it (a window's candidates include every remembered post), reconciled it,
-- found it right (fixed outside the job) or found it archived or gone. A post skipped again
-- by that sweep carries a newer skipped_at and stays.
DELETE FROM pin_nightly.news_skipped_post
 WHERE skipped_at < (SELECT max(started_at) FROM pin_nightly.sweep
                      WHERE job = %(job)s AND status = 'done' AND resumable)
