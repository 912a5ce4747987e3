-- Batch statement 1: the range's next cards after the cursor (not Delisted), locked with
-- SKIP LOCKED. Returns every candidate with whether we got its lock, and the locked counter.
WITH cand AS (
    SELECT id
      FROM {cards}
     WHERE (%(after_id)s::uuid IS NULL OR id > %(after_id)s::uuid)
       AND (%(upper_id)s::uuid IS NULL OR id <= %(upper_id)s::uuid)
       AND status IS DISTINCT FROM 'Delisted'
       AND (NOT %(targeted)s OR id = ANY(%(card_ids)s::uuid[]))
     ORDER BY id
     LIMIT %(limit)s
), locked AS (
    SELECT c.id, c.popularity_views
      FROM {cards} c
     WHERE c.id IN (SELECT id FROM cand) AND c.status IS DISTINCT FROM 'Delisted'
     ORDER BY c.id
       FOR UPDATE OF c SKIP LOCKED
)
SELECT k.id::text AS id, l.id IS NOT NULL AS locked, l.popularity_views AS views
  FROM cand k LEFT JOIN locked l ON l.id = k.id
 ORDER BY k.id
