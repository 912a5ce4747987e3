-- Least-privilege roles of the pin-nightly jobs: pin_news_job (news_comment_reconcile) and
-- pin_catalog_job (catalog_popularity_recompute).
--
-- Who applies it: a DBA (the owner of the tables, or a role allowed to grant on them), as the
-- last step of every migration of these schemas, in each database:
--   news database:     pin_nightly.sql, then this file
--   catalog database:  pin_nightly.sql, catalog_popularity.sql, then this file
-- Each section runs only where its domain schema exists, so the same file serves the news
-- database, the catalog database, or one database holding both. It is idempotent: it revokes
-- what the job roles hold on these objects and grants exactly the list below again.
--
-- The job-owned tables (schema pin_nightly, catalog.popularity_daily_views) are created by the
-- DBA with the files above; the job roles cannot create anything. At start a run only checks
-- that they exist (pin_nightly.db.ensure_schema) and fails with the name of the file to apply
-- when they do not.
--
-- pin_news_job and pin_catalog_job are NOLOGIN group roles that hold the privileges. The DBA
-- creates one LOGIN user per job and deployment, member of its group role, with a password that
-- never enters this repository, e.g. in psql (the password read from a secret file):
--   \set pw `cat /run/secrets/pin_news_job_password`
--   CREATE ROLE pin_news_job_login LOGIN PASSWORD :'pw' IN ROLE pin_news_job;
-- and puts that user and password into the Airflow connection news_db (catalog_db for
-- pin_catalog_job) through the secrets backend. Recommended on the login user (settings of a
-- group role are not inherited), so that a worker killed or hung in the middle of a batch does
-- not keep the batch's row locks (and the lease row) for long:
--   ALTER ROLE pin_news_job_login SET client_connection_check_interval = '10s';
--   ALTER ROLE pin_news_job_login SET idle_in_transaction_session_timeout = '5min';
-- (a backend blocked in a statement notices a vanished client only with the first setting;
-- the second ends a transaction left open between statements by a hung client).
--
-- Not granted on purpose: UPDATE of any other column of the domain tables (status, texts,
-- popularity_views), INSERT/DELETE/TRUNCATE on them, anything on news.comments but SELECT,
-- CREATE on any schema or on the database, ownership of anything.
-- Note: SELECT ... FOR NO KEY UPDATE needs UPDATE on at least one column of the table: the column
-- grants below are what lets a batch lock its posts or cards.

DO $roles$
BEGIN
    BEGIN
        CREATE ROLE pin_news_job NOLOGIN;
    EXCEPTION WHEN duplicate_object OR unique_violation THEN
        NULL;  -- exists (or is being created by a concurrent session)
    END;
    BEGIN
        CREATE ROLE pin_catalog_job NOLOGIN;
    EXCEPTION WHEN duplicate_object OR unique_violation THEN
        NULL;
    END;
END
$roles$;

DO $grants$
DECLARE
    job text;
BEGIN
    -- shared job state (lease, sweeps and range cursors, run log): whichever job lives here
    FOREACH job IN ARRAY ARRAY['pin_news_job', 'pin_catalog_job'] LOOP
        IF (job = 'pin_news_job' AND to_regnamespace('news') IS NULL)
           OR (job = 'pin_catalog_job' AND to_regnamespace('catalog') IS NULL) THEN
            CONTINUE;
        END IF;
        IF to_regclass('pin_nightly.popularity_skipped_card') IS NULL THEN
            RAISE EXCEPTION 'schema pin_nightly is missing or out of date: apply include/sql/schema/pin_nightly.sql first';
        END IF;
        EXECUTE format('GRANT CONNECT ON DATABASE %I TO %I', current_database(), job);
        EXECUTE format('REVOKE ALL ON ALL TABLES IN SCHEMA pin_nightly FROM %I', job);
        EXECUTE format('REVOKE ALL ON ALL SEQUENCES IN SCHEMA pin_nightly FROM %I', job);
        EXECUTE format('REVOKE ALL ON SCHEMA pin_nightly FROM %I', job);
        EXECUTE format('GRANT USAGE ON SCHEMA pin_nightly TO %I', job);
        -- lease: acquire (upsert), fence (SELECT ... FOR SHARE), renew, release (DELETE)
        EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON pin_nightly.job_lease TO %I', job);
        -- sweeps, range cursors, run log: created, advanced, closed; deleted past their
        -- retention by the runs themselves
        EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON pin_nightly.sweep, '
                       'pin_nightly.sweep_range, pin_nightly.run_log TO %I', job);
        -- what each run's summary sent: recorded once, pruned past its retention
        EXECUTE format('GRANT SELECT, INSERT, DELETE ON pin_nightly.run_signal TO %I', job);
        -- rows a batch could not write: recorded, pruned past their retention
        EXECUTE format('GRANT SELECT, INSERT, DELETE ON pin_nightly.item_error TO %I', job);
        -- controls over an open sweep: given from the console (on the job's connection), read
        -- by the ranges
        EXECUTE format('GRANT SELECT, INSERT, UPDATE ON pin_nightly.sweep_control TO %I', job);
        EXECUTE format('GRANT SELECT, INSERT ON pin_nightly.control_event TO %I', job);
        -- fencing tokens and sweep ids
        EXECUTE format('GRANT USAGE ON SEQUENCE pin_nightly.lease_token_seq, '
                       'pin_nightly.sweep_sweep_id_seq TO %I', job);
    END LOOP;

    IF to_regnamespace('news') IS NOT NULL THEN
        REVOKE ALL ON SCHEMA news FROM pin_news_job;
        REVOKE ALL ON news.posts, news.comments FROM pin_news_job;
        GRANT USAGE ON SCHEMA news TO pin_news_job;
        GRANT SELECT ON news.posts, news.comments TO pin_news_job;
        -- the only columns the job writes (and what lets it lock posts FOR NO KEY UPDATE)
        GRANT UPDATE (comments_count, updated_at) ON news.posts TO pin_news_job;
        -- news-only job state
        GRANT SELECT, INSERT, DELETE ON pin_nightly.news_drift TO pin_news_job;
        -- candidates of finished sweeps are deleted by the run's summary
        GRANT SELECT, INSERT, DELETE ON pin_nightly.news_window_candidate TO pin_news_job;
        GRANT SELECT, INSERT, UPDATE, DELETE ON pin_nightly.news_skipped_post TO pin_news_job;
    END IF;

    IF to_regnamespace('catalog') IS NOT NULL THEN
        IF to_regclass('catalog.popularity_daily_views') IS NULL THEN
            RAISE EXCEPTION 'catalog.popularity_daily_views is missing: apply '
                            'include/sql/schema/catalog_popularity.sql first';
        END IF;
        REVOKE ALL ON SCHEMA catalog FROM pin_catalog_job;
        REVOKE ALL ON catalog.property_object_cards, catalog.project_cards,
                      catalog.popularity_daily_views FROM pin_catalog_job;
        GRANT USAGE ON SCHEMA catalog TO pin_catalog_job;
        GRANT SELECT ON catalog.property_object_cards, catalog.project_cards TO pin_catalog_job;
        -- the only columns the job writes (and what lets it lock cards FOR NO KEY UPDATE)
        GRANT UPDATE (popularity_score, updated_at)
            ON catalog.property_object_cards, catalog.project_cards TO pin_catalog_job;
        -- the job's own snapshots: upsert, window reads, retention
        GRANT SELECT, INSERT, UPDATE, DELETE ON catalog.popularity_daily_views TO pin_catalog_job;
        -- the scores kept through the first nights: recorded, pruned past the horizon
        GRANT SELECT, INSERT, DELETE ON pin_nightly.popularity_inherited TO pin_catalog_job;
        -- cards left locked by others: remembered, forgotten once written
        GRANT SELECT, INSERT, UPDATE, DELETE ON pin_nightly.popularity_skipped_card
            TO pin_catalog_job;
        -- its partitions: created ahead of the nights, dropped past retention's horizon, by
        -- the table owner's SECURITY DEFINER functions (catalog_popularity.sql)
        IF to_regprocedure('catalog.popularity_ensure_partitions(date, date)') IS NOT NULL THEN
            REVOKE EXECUTE ON FUNCTION catalog.popularity_ensure_partitions(date, date),
                catalog.popularity_drop_partition(date, integer) FROM PUBLIC;
            GRANT EXECUTE ON FUNCTION catalog.popularity_ensure_partitions(date, date),
                catalog.popularity_drop_partition(date, integer) TO pin_catalog_job;
        END IF;
    END IF;
END
$grants$;

-- The console's reader (docs/operations.md, "The console"): pin_console_reader, a NOLOGIN group
-- role that may read the job state the console shows and nothing else. The DBA creates a login
-- user in it, as for the jobs above, and puts it into the Airflow connection <conn>_readonly
-- (news_db_readonly, catalog_db_readonly), which the console then uses instead of the job's own.
-- The console sets its sessions read-only besides; recommended on that login user too:
--   ALTER ROLE pin_console_login SET default_transaction_read_only = on;
DO $console$
BEGIN
    IF to_regclass('pin_nightly.run_log') IS NULL THEN
        RETURN;  -- no job state in this database
    END IF;
    BEGIN
        CREATE ROLE pin_console_reader NOLOGIN;
    EXCEPTION WHEN duplicate_object OR unique_violation THEN
        NULL;
    END;
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO pin_console_reader', current_database());
    REVOKE ALL ON ALL TABLES IN SCHEMA pin_nightly FROM pin_console_reader;
    REVOKE ALL ON ALL SEQUENCES IN SCHEMA pin_nightly FROM pin_console_reader;
    REVOKE ALL ON SCHEMA pin_nightly FROM pin_console_reader;
    GRANT USAGE ON SCHEMA pin_nightly TO pin_console_reader;
    GRANT SELECT ON pin_nightly.job_lease, pin_nightly.sweep, pin_nightly.sweep_range,
                    pin_nightly.run_log, pin_nightly.item_error, pin_nightly.sweep_control
                 TO pin_console_reader;
END
$console$;

-- Pacing on the database's health (docs/operations.md): the jobs read replica lag (pg_stat_replication)
-- and VACUUM progress (pg_stat_progress_vacuum) of sessions that are not theirs, which only
-- members of pg_read_all_stats see (it reveals statistics and the queries of other sessions,
-- never data). Granting a predefined role needs a superuser (or ADMIN OPTION on it): a DBA
-- without it gets a warning and the jobs pace on the other signals only.
DO $pacing$
BEGIN
    GRANT pg_read_all_stats TO pin_news_job, pin_catalog_job;
EXCEPTION WHEN insufficient_privilege THEN
    RAISE WARNING 'pin_news_job and pin_catalog_job are not members of pg_read_all_stats: '
                  'pacing cannot see replica lag or VACUUM progress (a superuser grants it)';
END
$pacing$;

-- The console shows the same signals: its reader sees them with the same membership.
DO $console_stats$
BEGIN
    IF to_regrole('pin_console_reader') IS NOT NULL THEN
        GRANT pg_read_all_stats TO pin_console_reader;
    END IF;
EXCEPTION WHEN insufficient_privilege THEN
    RAISE WARNING 'pin_console_reader is not a member of pg_read_all_stats: the console shows '
                  'no replica lag or VACUUM progress (a superuser grants it)';
END
$console_stats$;

-- Optional, PostgreSQL 15+ (a superuser grants it): let the jobs' sessions compress the
-- full-page images of the WAL they write. Where the role may, every session of a job sets
-- wal_compression to zstd (else lz4, else pglz) when the server leaves it off (common/wal_compression);
-- without the grant they write as the server is set. What it saves: bench/RESULTS.md.
--   GRANT SET ON PARAMETER wal_compression TO pin_news_job, pin_catalog_job;
