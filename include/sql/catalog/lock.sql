-- End-of-range retry of cards a batch skipped because locked: after statement 1
-- (compute.sql) has read them, wait for their row locks (bounded by the transaction's
-- lock_timeout); statement 2 (apply.sql) then finds them locked by this transaction and
-- writes them. Cards Delisted meanwhile are not locked, and so not written.
SELECT c.id::text AS id
  FROM {cards} c
 WHERE c.id = ANY(%(ids)s::uuid[]) AND c.status IS DISTINCT FROM 'Delisted'
 ORDER BY c.id
   FOR NO KEY UPDATE OF c
