SELECT r.range_no, r.lower_id::text AS lower_id, r.upper_id::text AS upper_id,
       r.cursor_id::text AS cursor_id, r.status, r.run_id, s.status AS sweep_status
  FROM pin_nightly.sweep_range r JOIN pin_nightly.sweep s USING (sweep_id)
 WHERE r.sweep_id = %(sweep_id)s AND r.range_no = %(range_no)s
