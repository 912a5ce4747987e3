SELECT range_no, lower_id::text AS lower_id, upper_id::text AS upper_id,
       cursor_id::text AS cursor_id, planned_rows, status
  FROM pin_nightly.sweep_range
 WHERE sweep_id = %(sweep_id)s
 ORDER BY range_no
