-- Batch statement 1, read only, no row lock: the range's next cards after the cursor (not
-- Delisted), their counters, and the score each card gets with its counter as tonight's
-- snapshot. Statement 2 (apply.sql) then locks the cards SKIP LOCKED and writes exactly these
-- values. Why reading before the lock is correct: docs/design.md (catalog_popularity_recompute).
--   score(D) = round( sum over snapshots k with run_date in (D - W, D] of
--                     max(0, S_k - S_prev(k)) * 2^(-(D - run_date_k) / H), 4)
-- S_prev(k) is the newest earlier snapshot of the card within the retention horizon
-- (run_date >= D - (W + 2)): a night at the window's edge that follows a missed night still
-- finds it. A snapshot without one is a baseline (delta 0); snapshots older than the window
-- only serve as predecessors (no weight). Tonight's stored snapshot, if any (a re-run of the
-- date), is not read: tonight's value is the counter read here, which statement 2 upserts.
-- A NULL or negative counter gets no score (poison: the job writes nothing for it).
-- The first nights (docs/design.md#first-nights): while the job's history does not cover the
-- window (no snapshot on or before D - W), a card without an earlier snapshot inherits the
-- score it has, if any (returned as `inherit`, recorded by apply.sql), and a card with an inherited
-- score of a night E > D - W scores the formula plus that score * 2^(-(D - E) / H): the part of
-- its window the job has no history of. Nothing changes once the window is covered.
-- The keyset bounds are sargable (coalesce, not "IS NULL OR"): a generic plan of the
-- prepared statement still starts its index scan at the cursor.
WITH cards AS MATERIALIZED (
    SELECT id, popularity_views AS views, popularity_score
      FROM {cards}
     WHERE id >= coalesce(%(after_id)s::uuid, '00000000-0000-0000-0000-000000000000'::uuid)
       AND (%(after_id)s::uuid IS NULL OR id <> %(after_id)s::uuid)
       AND id <= coalesce(%(upper_id)s::uuid, 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid)
       AND status IS DISTINCT FROM 'Delisted'
       AND (NOT %(targeted)s OR id = ANY(%(card_ids)s::uuid[]))
     ORDER BY id
     LIMIT %(limit)s
), valid AS (
    SELECT id, views FROM cards WHERE views IS NOT NULL AND views >= 0
), hist AS (
    SELECT s.card_id, s.run_date, s.cumulative_views
      FROM catalog.popularity_daily_views s
     WHERE s.card_kind = %(kind)s
       -- a batch's cards are consecutive ids (not so a targeted run's): one range scan of
       -- each night's partition reads them all, instead of a probe a card a partition (the
       -- rows of cards not in the batch, Delisted or poison, get no score: see the end)
       AND (NOT %(targeted)s OR s.card_id IN (SELECT id FROM valid))
       AND (%(targeted)s
            OR s.card_id BETWEEN (SELECT id FROM valid ORDER BY id LIMIT 1)
                             AND (SELECT id FROM valid ORDER BY id DESC LIMIT 1))
       AND s.run_date >= %(as_of)s::date - (%(window_days)s + 2)
       AND s.run_date < %(as_of)s::date
    UNION ALL
    SELECT id, %(as_of)s::date, views FROM valid
), deltas AS (
    SELECT card_id, run_date,
           cumulative_views - lag(cumulative_views) OVER w AS delta
      FROM hist
    WINDOW w AS (PARTITION BY card_id ORDER BY run_date)
), weights AS MATERIALIZED (  -- computed once, not once a row of the join
    SELECT age, power(2::numeric, -age::numeric / %(half_life)s::numeric) AS weight
      FROM generate_series(0, %(window_days)s - 1) AS age
), scores AS (
    SELECT d.card_id, coalesce(sum(greatest(d.delta, 0) * w.weight), 0) AS score,
           count(*) = 1 AS first  -- tonight's value only: no earlier snapshot in the horizon
      FROM deltas d
      LEFT JOIN weights w ON w.age = %(as_of)s::date - d.run_date AND d.delta IS NOT NULL
     GROUP BY d.card_id
), inherited AS (
    SELECT i.card_id, i.score * w.weight AS score
      FROM pin_nightly.popularity_inherited i
      JOIN weights w ON w.age = %(as_of)s::date - i.as_of
     WHERE i.card_kind = %(kind)s AND i.card_id IN (SELECT id FROM valid)
), warm_up AS (  -- the job's history does not cover tonight's window yet
    SELECT NOT EXISTS (SELECT FROM catalog.popularity_daily_views
                        WHERE run_date <= %(as_of)s::date - %(window_days)s) AS active
), result AS (
    SELECT c.id, c.views, s.score, i.score AS inherited,
           CASE WHEN s.first AND i.card_id IS NULL AND c.popularity_score > 0
                     AND (SELECT active FROM warm_up)
                THEN c.popularity_score END AS inherit
      FROM cards c
      LEFT JOIN scores s ON s.card_id = c.id
      LEFT JOIN inherited i ON i.card_id = c.id
)
SELECT id::text AS id, views, round(score + coalesce(inherited, inherit, 0), 4) AS score, inherit
  FROM result
 ORDER BY id
