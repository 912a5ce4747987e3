-- Domain tables of the news service, as the job expects them. The news service owns them in
-- production; the demo and the tests create them with this file.
CREATE SCHEMA IF NOT EXISTS news;
CREATE TABLE IF NOT EXISTS news.posts (
    id             uuid PRIMARY KEY,
    status         text,
    comments_count integer NOT NULL DEFAULT 0,
    updated_at     timestamptz
);
CREATE TABLE IF NOT EXISTS news.comments (
    id         uuid PRIMARY KEY,
    post_id    uuid NOT NULL,
    status     text NOT NULL,
    created_at timestamptz,
    updated_at timestamptz
);
