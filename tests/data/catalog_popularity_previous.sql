-- Job-owned table of catalog_popularity_recompute: daily snapshots of the cumulative view
-- counters. Idempotent: the DAG applies it when the table is absent.
CREATE SCHEMA IF NOT EXISTS catalog;
CREATE TABLE IF NOT EXISTS catalog.popularity_daily_views (
    id               uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    card_kind        varchar(16) NOT NULL CHECK (card_kind IN ('PropertyObject', 'Project')),
    card_id          uuid        NOT NULL,
    run_date         date        NOT NULL,
    cumulative_views bigint      NOT NULL CHECK (cumulative_views >= 0),
    created_at       timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX IF NOT EXISTS ix_popularity_daily_unique
    ON catalog.popularity_daily_views (card_kind, card_id, run_date);
CREATE INDEX IF NOT EXISTS ix_popularity_daily_window
    ON catalog.popularity_daily_views (card_kind, card_id, run_date DESC);
-- Retention deletes by run_date and the backfill guard reads max(run_date).
CREATE INDEX IF NOT EXISTS ix_popularity_daily_run_date
    ON catalog.popularity_daily_views (run_date);
