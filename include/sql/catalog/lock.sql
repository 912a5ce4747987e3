-- Batch statement 1: the range's next cards after the cursor (not Delisted), locked with
-- SKIP LOCKED. Returns every candidate with whether we got its lock, and the locked counter.
-- The keyset bounds are sargable (coalesce, not "IS NULL OR"): a generic plan of the
-- prepared statement still starts its index scan at the cursor.
WITH cand AS (
    SELECT id
      FROM {cards}
     WHERE id >= coalesce(%(after_id)s::uuid, '00000000-0000-0000-0000-000000000000'::uuid)
       AND (%(after_id)s::uuid IS NULL OR id <> %(after_id)s::uuid)
       AND id <= coalesce(%(upper_id)s::uuid, 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid)
       AND status IS DISTINCT FROM 'Delisted'
       AND (NOT %(targeted)s OR id = ANY(%(card_ids)s::uuid[]))
     ORDER BY id
     LIMIT %(limit)s
), locked AS (
    SELECT c.id, c.popularity_views
      FROM {cards} c
     WHERE c.id IN (SELECT id FROM cand) AND c.status IS DISTINCT FROM 'Delisted'
     ORDER BY c.id
       FOR NO KEY UPDATE OF c SKIP LOCKED
)
SELECT k.id::text AS id, l.id IS NOT NULL AS locked, l.popularity_views AS views
  FROM cand k LEFT JOIN locked l ON l.id = k.id
 ORDER BY k.id
