-- Every pin_step-th id of the keyset source: the inner boundaries of equal-sized ranges.
SELECT id::text
  FROM (SELECT id, row_number() OVER (ORDER BY id) AS rn FROM ({source}) AS src) AS numbered
 WHERE rn %% %(pin_step)s = 0 AND rn < %(pin_total)s
 ORDER BY id
