-- Window candidates are kept only while their sweep can still run: those of sweeps that are
-- done or abandoned go, and so do those of a sweep that no later run can adopt (a dry run or a
-- targeted repair that stopped at its time budget) once another run summarizes.
DELETE FROM pin_nightly.news_window_candidate c
 USING pin_nightly.sweep s
 WHERE s.sweep_id = c.sweep_id AND s.job = %(job)s
   AND (s.status <> 'open' OR (NOT s.resumable AND s.owner <> %(owner)s))
