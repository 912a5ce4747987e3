-- Posts skipped because locked are remembered until a run reconciles them.
INSERT INTO pin_nightly.news_skipped_post (post_id)
SELECT unnest(%(ids)s::uuid[])
ON CONFLICT (post_id) DO UPDATE SET skipped_at = excluded.skipped_at
