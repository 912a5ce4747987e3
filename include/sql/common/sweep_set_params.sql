UPDATE pin_nightly.sweep SET params = params || %(params)s::jsonb WHERE sweep_id = %(sweep_id)s
