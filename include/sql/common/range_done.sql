UPDATE pin_nightly.sweep_range
   SET status = 'done', updated_at = clock_timestamp()
 WHERE sweep_id = %(sweep_id)s AND range_no = %(range_no)s
