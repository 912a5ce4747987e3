-- Batch statement 2, the batch's only row locks: for the cards statement 1 (compute.sql) read,
-- upsert tonight's snapshot with the counter statement 1 read (job-owned rows: no card lock
-- needed), then lock the cards FOR NO KEY UPDATE SKIP LOCKED, only while still not Delisted
-- (checked on the locked row), and write the score statement 1 computed from that same value
-- to popularity_score and updated_at where the score changes (compared on the locked row). The
-- locks are taken after the upsert (locked reads its RETURNING rows, which the semi-join hashes
-- whole first) and held to the commit, so the view consumer waits for the score writes only.
-- Scores that do not fit numeric(12,4) are not written (their snapshot is) and are returned as
-- poison. The cards not locked (held by a concurrent transaction: skipped_ids, retried at the
-- range's end; or Delisted or deleted since statement 1) keep no snapshot of tonight: undo_*
-- lists them with the snapshot they had before (a re-run of the date), which unapply.sql puts
-- back in the same transaction, so no other session ever sees it. Why the values may be
-- computed before the lock: docs/design.md.
-- A new snapshot's id is time-ordered (uuid v7, common/uuid7_now.sql), so a night's rows go to
-- the right edge of the primary key's index instead of one random leaf page each (a full-page
-- image in the WAL per page; see bench/RESULTS.md).
WITH input AS (
    SELECT b.card_id, b.views, b.score, b.inherit
      FROM unnest(%(ids)s::uuid[], %(views)s::bigint[], %(scores)s::numeric[],
                  %(inherit)s::numeric[]) AS b(card_id, views, score, inherit)
), snap AS (
    INSERT INTO catalog.popularity_daily_views
           (id, card_kind, card_id, run_date, cumulative_views, created_at)
    SELECT {uuid7_now},
           %(kind)s, card_id, %(as_of)s::date, views, clock_timestamp()
      FROM input
    ON CONFLICT (card_kind, card_id, run_date) DO UPDATE
       SET cumulative_views = excluded.cumulative_views, created_at = excluded.created_at
    RETURNING card_id
), locked AS (
    SELECT c.id
      FROM {cards} c
     WHERE c.id IN (SELECT card_id FROM snap) AND c.status IS DISTINCT FROM 'Delisted'
     ORDER BY c.id
       FOR NO KEY UPDATE OF c SKIP LOCKED
), todo AS (
    SELECT i.card_id, i.score FROM input i JOIN locked l ON l.id = i.card_id
), updated AS (
    UPDATE {cards} c
       SET popularity_score = t.score, updated_at = clock_timestamp()
      FROM todo t
     WHERE c.id = t.card_id
       AND t.score <= 99999999.9999
       AND c.popularity_score IS DISTINCT FROM t.score
    RETURNING c.id
), inherited AS (  -- the score a locked card had at its first snapshot (compute.sql)
    INSERT INTO pin_nightly.popularity_inherited (card_kind, card_id, score, as_of)
    SELECT %(kind)s, i.card_id, i.inherit, %(as_of)s::date
      FROM input i JOIN locked l ON l.id = i.card_id
     WHERE i.inherit IS NOT NULL
    ON CONFLICT (card_kind, card_id) DO NOTHING
), undo AS (
    -- the statement's snapshot: what was stored before the upsert above
    SELECT i.card_id, o.cumulative_views AS views, o.created_at
      FROM input i
      LEFT JOIN catalog.popularity_daily_views o
        ON o.card_kind = %(kind)s AND o.card_id = i.card_id AND o.run_date = %(as_of)s::date
     WHERE i.card_id NOT IN (SELECT id FROM locked)
), skipped AS (  -- held by a concurrent transaction (not Delisted or deleted since statement 1)
    SELECT c.id FROM {cards} c
     WHERE c.id IN (SELECT card_id FROM undo) AND c.status IS DISTINCT FROM 'Delisted'
), remembered AS (  -- until a later batch writes them (the end-of-range retry, a later night)
    INSERT INTO pin_nightly.popularity_skipped_card (card_kind, card_id, as_of)
    SELECT %(kind)s, id, %(as_of)s::date FROM skipped
    ON CONFLICT (card_kind, card_id) DO UPDATE
       SET as_of = greatest(excluded.as_of, pin_nightly.popularity_skipped_card.as_of),
           skipped_at = excluded.skipped_at
), forgotten AS (
    DELETE FROM pin_nightly.popularity_skipped_card
     WHERE card_kind = %(kind)s AND card_id IN (SELECT id FROM locked)
)
SELECT (SELECT count(*) FROM updated) AS cards_updated,
       (SELECT count(*) FROM todo)    AS cards_locked,
       (SELECT coalesce(array_agg(card_id::text ORDER BY card_id), '{}')
          FROM todo WHERE score > 99999999.9999) AS overflow_ids,
       (SELECT coalesce(array_agg(id::text ORDER BY id), '{}') FROM skipped) AS skipped_ids,
       (SELECT coalesce(array_agg(card_id::text ORDER BY card_id), '{}') FROM undo) AS undo_ids,
       (SELECT array_agg(views ORDER BY card_id) FROM undo) AS undo_views,
       (SELECT array_agg(created_at ORDER BY card_id) FROM undo) AS undo_created
