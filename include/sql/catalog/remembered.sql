-- The cards of this kind that an earlier night left locked through its end-of-range retry
-- (pin_nightly.popularity_skipped_card), in the range (lower_id, upper_id] (NULL: an open end):
-- the range takes them first, before its batches.
SELECT card_id::text
  FROM pin_nightly.popularity_skipped_card
 WHERE card_kind = %(kind)s
   AND (%(lower_id)s::uuid IS NULL OR card_id > %(lower_id)s::uuid)
   AND (%(upper_id)s::uuid IS NULL OR card_id <= %(upper_id)s::uuid)
 ORDER BY card_id
 LIMIT %(limit)s
