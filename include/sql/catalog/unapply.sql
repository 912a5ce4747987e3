-- After statement 2 (apply.sql), only for the cards it did not lock: put back tonight's
-- snapshot each had before statement 2 upserted it (views and created_at; the row keeps its id),
-- or delete the row where there was none. In the batch's transaction, before its commit.
WITH u AS (
    SELECT u.card_id, u.views, u.created_at
      FROM unnest(%(ids)s::uuid[], %(views)s::bigint[], %(created)s::timestamptz[])
           AS u(card_id, views, created_at)
), dropped AS (
    DELETE FROM catalog.popularity_daily_views s
     USING u
     WHERE s.card_kind = %(kind)s AND s.run_date = %(as_of)s::date AND s.card_id = u.card_id
       AND u.views IS NULL
    RETURNING s.card_id
), restored AS (
    UPDATE catalog.popularity_daily_views s
       SET cumulative_views = u.views, created_at = u.created_at
      FROM u
     WHERE s.card_kind = %(kind)s AND s.run_date = %(as_of)s::date AND s.card_id = u.card_id
       AND u.views IS NOT NULL
    RETURNING s.card_id
)
SELECT (SELECT count(*) FROM dropped) + (SELECT count(*) FROM restored) AS put_back
