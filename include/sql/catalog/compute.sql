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
-- The keyset bounds are sargable (coalesce, not "IS NULL OR"): a generic plan of the
-- prepared statement still starts its index scan at the cursor.
WITH cards AS MATERIALIZED (
    SELECT id, popularity_views AS views
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
       AND s.card_id IN (SELECT id FROM valid)
       AND s.run_date >= %(as_of)s::date - (%(window_days)s + 2)
       AND s.run_date < %(as_of)s::date
    UNION ALL
    SELECT id, %(as_of)s::date, views FROM valid
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
)
SELECT c.id::text AS id, c.views, s.score
  FROM cards c
  LEFT JOIN scores s ON s.card_id = c.id
 ORDER BY c.id
