-- Targeted repair: exactly the posts asked for.
INSERT INTO pin_nightly.news_window_candidate (sweep_id, post_id)
SELECT %(sweep_id)s, unnest(%(post_ids)s::uuid[])
ON CONFLICT DO NOTHING
