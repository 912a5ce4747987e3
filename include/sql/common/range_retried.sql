-- A post or card taken on the end-of-range retry is no longer counted as skipped.
UPDATE pin_nightly.sweep_range
   SET rows_processed = rows_processed + %(processed)s,
       rows_changed   = rows_changed + %(changed)s,
       skipped_locked = skipped_locked - %(processed)s,
       rows_written   = rows_written + %(written)s,
       item_errors    = item_errors + %(item_errors)s,
       updated_at     = clock_timestamp()
 WHERE sweep_id = %(sweep_id)s AND range_no = %(range_no)s
