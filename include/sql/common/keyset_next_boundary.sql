-- The id %(pin_skip)s rows past the previous boundary in keyset order (the first: from the
-- start): the next inner boundary of equal-sized ranges. An index scan that stops there, so
-- all boundaries together read the keyset about once, without numbering every row.
-- The source is a keyset source query from include/sql, never from input.
-- Ordered by src.id, the uuid: a bare "id" would name the text output column.
SELECT src.id::text AS boundary
  FROM ({source}) AS src
 WHERE src.id >= coalesce(%(pin_after)s::uuid, '00000000-0000-0000-0000-000000000000'::uuid)
   AND (%(pin_after)s::uuid IS NULL OR src.id <> %(pin_after)s::uuid)
 ORDER BY src.id
OFFSET %(pin_skip)s
 LIMIT 1
