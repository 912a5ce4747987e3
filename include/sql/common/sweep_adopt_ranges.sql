-- The adopting run starts its own counters on the ranges that are left.
UPDATE pin_nightly.sweep_range
   SET run_id = %(run_id)s, rows_processed = 0, rows_changed = 0, batches = 0,
       skipped_locked = 0, item_errors = 0, rows_written = 0, updated_at = clock_timestamp()
 WHERE sweep_id = %(sweep_id)s AND status = 'pending' AND run_id <> %(run_id)s
