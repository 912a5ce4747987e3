INSERT INTO pin_nightly.sweep_range (sweep_id, range_no, lower_id, upper_id, planned_rows, run_id)
VALUES (%(sweep_id)s, %(range_no)s, %(lower_id)s::uuid, %(upper_id)s::uuid, %(planned_rows)s,
        %(run_id)s)
