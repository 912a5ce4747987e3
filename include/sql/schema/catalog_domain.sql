-- Domain tables of the catalog service, as the job expects them. The catalog service owns them
-- in production; the demo and the tests create them with this file.
CREATE SCHEMA IF NOT EXISTS catalog;
CREATE TABLE IF NOT EXISTS catalog.property_object_cards (
    id               uuid PRIMARY KEY,
    status           text,
    popularity_views bigint,
    popularity_score numeric(12,4) NOT NULL DEFAULT 0,
    updated_at       timestamptz
);
CREATE TABLE IF NOT EXISTS catalog.project_cards (
    id               uuid PRIMARY KEY,
    status           text,
    popularity_views bigint,
    popularity_score numeric(12,4) NOT NULL DEFAULT 0,
    updated_at       timestamptz
);
