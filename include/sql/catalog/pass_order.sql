-- The passes of the newest date before as_of that a real run (not dry, not targeted) worked with
-- this formula (scope suffix: '' for the nightly's, ' window 10d half-life 7d' otherwise): each
-- family's newest sweep of that date and whether it finished (done, or all its ranges done: a
-- sweep whose summary never ran is closed by the next planning, and the order must not change
-- between tonight's two planning tasks). The sweep ids give the order the passes were opened
-- in, which is the order they ran.
SELECT DISTINCT ON (s.family) s.family, s.sweep_id,
       CASE WHEN s.status = 'done' OR NOT EXISTS (
                 SELECT 1 FROM pin_nightly.sweep_range r
                  WHERE r.sweep_id = s.sweep_id AND r.status <> 'done')
            THEN 'done' ELSE s.status END AS status
  FROM pin_nightly.sweep s
 WHERE s.job = %(job)s AND s.resumable
   AND s.scope = s.family || '@' || (s.params ->> 'as_of_date') || %(suffix)s
   AND (s.params ->> 'as_of_date')::date = (
        SELECT max((p.params ->> 'as_of_date')::date) FROM pin_nightly.sweep p
         WHERE p.job = %(job)s AND p.resumable
           AND p.scope = p.family || '@' || (p.params ->> 'as_of_date') || %(suffix)s
           AND (p.params ->> 'as_of_date')::date < %(as_of)s::date)
 ORDER BY s.family, s.sweep_id DESC
