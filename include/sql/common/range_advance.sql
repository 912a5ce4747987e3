-- Checkpoint: advance the range cursor in the batch's own transaction.
UPDATE pin_nightly.sweep_range
   SET cursor_id      = coalesce(%(cursor_id)s::uuid, cursor_id),
       rows_processed = rows_processed + %(processed)s,
       rows_changed   = rows_changed + %(changed)s,
       batches        = batches + 1,
       skipped_locked = skipped_locked + %(skipped)s,
       item_errors    = item_errors + %(item_errors)s,
       rows_written   = rows_written + %(written)s,
       updated_at     = clock_timestamp()
 WHERE sweep_id = %(sweep_id)s AND range_no = %(range_no)s AND status = 'pending'
RETURNING cursor_id::text
