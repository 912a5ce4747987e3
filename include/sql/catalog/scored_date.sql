-- The newest as_of_date whose passes all completed in real runs (no dry run, no targeted
-- recompute) with the nightly's formula (a run with another window or half-life works passes
-- of its own, whose scope carries the formula: not the date's scoring) and not failed in most
-- of their rows (common/sweep_trusted): every card's score is
-- computed for it. Its age is the staleness of the scores,
-- whatever the runs since then did (failed, backlog, backfill guard); the cards a night left
-- without a snapshot and a score because others held them (pin_nightly.popularity_skipped_card).
SELECT (params ->> 'as_of_date')::date AS as_of_date,
       extract(epoch FROM (params ->> 'as_of_date')::date::timestamp AT TIME ZONE 'UTC')::float8
           AS as_of_epoch,
       extract(epoch FROM clock_timestamp()
               - (params ->> 'as_of_date')::date::timestamp AT TIME ZONE 'UTC')::float8 / 3600.0
           AS staleness_hours,
       (SELECT count(*) FROM pin_nightly.popularity_skipped_card) AS cards_unscored
  FROM pin_nightly.sweep
 WHERE job = %(job)s AND status = 'done' AND resumable AND {common/sweep_trusted}
   AND scope = family || '@' || (params ->> 'as_of_date')
 GROUP BY params ->> 'as_of_date'
HAVING count(DISTINCT family) = %(passes)s
 ORDER BY 1 DESC
 LIMIT 1
