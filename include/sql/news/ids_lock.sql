-- End-of-range retry of posts skipped because locked: lock them, waiting for each lock
-- (bounded by the transaction's lock_timeout), and hand them all to news/apply for a recount.
-- Same columns as full_lock.sql.
WITH locked AS (
    SELECT p.id
      FROM news.posts p
     WHERE p.id = ANY(%(ids)s::uuid[]) AND p.status IS DISTINCT FROM 'Archived'
     ORDER BY p.id
       FOR NO KEY UPDATE OF p
)
SELECT cardinality(%(ids)s::uuid[])                         AS n_read,
       (SELECT count(*) FROM locked)                        AS n_eligible,
       NULL::text                                           AS last_id,
       ARRAY(SELECT x.id::text FROM locked x ORDER BY x.id) AS suspect_ids,
       ARRAY(SELECT x.id::text FROM locked x ORDER BY x.id) AS locked_ids
