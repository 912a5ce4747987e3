SELECT post_id AS id FROM pin_nightly.news_window_candidate WHERE sweep_id = %(sweep_id)s
