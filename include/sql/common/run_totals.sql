-- What this run did, from the counters of the ranges it owned.
SELECT r.sweep_id, s.scope, s.family, s.status AS sweep_status,
       count(*)                                   AS ranges,
       count(*) FILTER (WHERE r.status = 'done')  AS ranges_done,
       coalesce(sum(r.rows_processed), 0)::bigint AS rows_processed,
       coalesce(sum(r.rows_changed), 0)::bigint   AS rows_changed,
       coalesce(sum(r.batches), 0)::bigint        AS batches,
       coalesce(sum(r.skipped_locked), 0)::bigint AS skipped_locked,
       coalesce(sum(r.item_errors), 0)::bigint    AS item_errors,
       coalesce(sum(r.rows_written), 0)::bigint   AS rows_written,
       max(r.cursor_id::text)                     AS last_id
  FROM pin_nightly.sweep_range r JOIN pin_nightly.sweep s USING (sweep_id)
 WHERE s.job = %(job)s AND r.run_id = %(run_id)s
 GROUP BY r.sweep_id, s.scope, s.family, s.status
 ORDER BY r.sweep_id
