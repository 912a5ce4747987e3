-- Batch statement 2, on the cards locked by statement 1 (their counters cannot move until we
-- commit): upsert today's snapshot of each valid counter, compute the decayed score of each card
-- from the snapshots in the window (one query for the whole batch), and write popularity_score
-- and updated_at only where the score changes.
--   score(D) = round( sum over snapshots k with run_date in (D - W, D] of
--                     max(0, S_k - S_prev(k)) * 2^(-(D - run_date_k) / H), 4)
-- S_prev(k) is the newest earlier snapshot of the card within the retention horizon
-- (run_date >= D - (W + 2)): a night at the window's edge that follows a missed night still
-- finds it. A snapshot without one is a baseline (delta 0); snapshots older than the window
-- only serve as predecessors (no weight). Scores that do not fit numeric(12,4) are not written
-- and are returned as poison.
-- A new snapshot's id is time-ordered (uuid v7, common/uuid7_now.sql), so a night's rows go to
-- the right edge of the primary key's index instead of one random leaf page each (a full-page
-- image in the WAL per page; see bench/RESULTS.md).
WITH batch AS (
    SELECT b.card_id, b.views
      FROM unnest(%(ids)s::uuid[], %(views)s::bigint[]) AS b(card_id, views)
     WHERE b.views IS NOT NULL AND b.views >= 0
), snap AS (
    INSERT INTO catalog.popularity_daily_views
           (id, card_kind, card_id, run_date, cumulative_views, created_at)
    SELECT {uuid7_now},
           %(kind)s, card_id, %(as_of)s::date, views, clock_timestamp()
      FROM batch
    ON CONFLICT (card_kind, card_id, run_date) DO UPDATE
       SET cumulative_views = excluded.cumulative_views, created_at = excluded.created_at
    RETURNING card_id
), hist AS (
    SELECT s.card_id, s.run_date, s.cumulative_views
      FROM catalog.popularity_daily_views s
     WHERE s.card_kind = %(kind)s
       AND s.card_id IN (SELECT card_id FROM batch)
       AND s.run_date >= %(as_of)s::date - (%(window_days)s + 2)
       AND s.run_date < %(as_of)s::date
    UNION ALL
    SELECT card_id, %(as_of)s::date, views FROM batch
), deltas AS (
    SELECT card_id, run_date,
           cumulative_views - lag(cumulative_views) OVER w AS delta
      FROM hist
    WINDOW w AS (PARTITION BY card_id ORDER BY run_date)
), weights AS (
    SELECT age, power(2::numeric, -age::numeric / %(half_life)s::numeric) AS weight
      FROM generate_series(0, %(window_days)s - 1) AS age
), scores AS (
    SELECT d.card_id,
           round(coalesce(sum(greatest(d.delta, 0) * w.weight), 0), 4) AS score
      FROM deltas d
      LEFT JOIN weights w ON w.age = %(as_of)s::date - d.run_date AND d.delta IS NOT NULL
     GROUP BY d.card_id
), updated AS (
    UPDATE {cards} c
       SET popularity_score = s.score, updated_at = clock_timestamp()
      FROM scores s
     WHERE c.id = s.card_id
       AND s.score <= 99999999.9999
       AND c.popularity_score IS DISTINCT FROM s.score
    RETURNING c.id
)
SELECT (SELECT count(*) FROM snap)    AS snapshots_written,
       (SELECT count(*) FROM updated) AS cards_updated,
       (SELECT coalesce(array_agg(card_id::text ORDER BY card_id), '{}')
          FROM scores WHERE score > 99999999.9999) AS overflow_ids
