-- The upgrade of the previous release's catalog.popularity_daily_views (one table) to the
-- partitioned layout of schema/catalog_popularity.sql: the DBA's command, step by step
-- (python -m pin_nightly.partitions, pin_nightly.partitions.upgrade); until it is done the job
-- writes its nights to the old table. Nothing here locks a card table. The old table becomes
-- one range partition, popularity_daily_views_legacy, covering [its oldest night, the week
-- after tonight) so that no row moves; retention drops it whole once all its nights are past
-- the horizon.

-- name: upgrade_session
-- For the command's whole session, whatever its role or database sets: no statement_timeout
-- (a long step, an index built concurrently or a full scan, runs as long as the table needs)
-- and no lock_timeout (it waits for the job's batches in flight; the locks it takes, SHARE
-- UPDATE EXCLUSIVE, let the job's writes go on). Each short step sets its own lock_timeout.
SELECT set_config('statement_timeout', '0', false), set_config('lock_timeout', '0', false)

-- name: migrate_facts
-- Where the upgrade stands: the old table's nights and size, the indexes it builds (NULL:
-- absent, false: left invalid by an interrupted build) and its range check (NULL: absent;
-- validated or not, and the nights it admits, [check_from, check_to)).
SELECT {common/today} AS today,
       (SELECT min(run_date) FROM catalog.popularity_daily_views) AS oldest,
       (SELECT max(run_date) FROM catalog.popularity_daily_views) AS newest,
       pg_size_pretty(pg_total_relation_size('catalog.popularity_daily_views')) AS size,
       (SELECT indisvalid FROM pg_index
         WHERE indexrelid = to_regclass('catalog.popularity_daily_views_legacy_id_run_date'))
           AS key_valid,
       (SELECT indisvalid FROM pg_index
         WHERE indexrelid = to_regclass('catalog.ix_popularity_daily_run_date'))
           AS run_date_valid,
       ck.convalidated AS check_valid,
       ck.bounds[1]::date AS check_from,
       ck.bounds[2]::date AS check_to
  FROM (SELECT 1) AS one
  LEFT JOIN (SELECT c.convalidated,
                    regexp_match(pg_get_constraintdef(c.oid),
                                 '(\d\d\d\d-\d\d-\d\d).*(\d\d\d\d-\d\d-\d\d)')
                        AS bounds
               FROM pg_constraint c
              WHERE c.conrelid = 'catalog.popularity_daily_views'::regclass
                AND c.conname = 'popularity_daily_views_legacy_range') AS ck ON true

-- name: upgrade_progress
-- What the command's session (its backend's pid) is doing, read from a second session: how
-- long its statement has run, what it waits for, and an index build's phase, blocks and tuples.
SELECT extract(epoch FROM clock_timestamp() - a.query_start)::int AS seconds,
       a.wait_event_type, a.wait_event, p.phase, p.blocks_done, p.blocks_total,
       p.tuples_done, p.tuples_total
  FROM pg_stat_activity a
  LEFT JOIN pg_stat_progress_create_index p ON p.pid = a.pid
 WHERE a.pid = %(pid)s

-- name: migrate_drop_key
DROP INDEX CONCURRENTLY IF EXISTS catalog.popularity_daily_views_legacy_id_run_date

-- name: migrate_key
-- The partitioned table's primary key (id, run_date) attaches this index of the old table.
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS popularity_daily_views_legacy_id_run_date
    ON catalog.popularity_daily_views (id, run_date)

-- name: migrate_drop_run_date
DROP INDEX CONCURRENTLY IF EXISTS catalog.ix_popularity_daily_run_date

-- name: migrate_run_date
CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_popularity_daily_run_date
    ON catalog.popularity_daily_views (run_date)

-- name: migrate_room
-- For the rest of the transaction: how many nights after tonight the range check admits
-- (pin_nightly.partitions.AHEAD_DAYS, the week the job makes partitions for ahead).
SELECT set_config('pin_nightly.upgrade_room', %(nights)s, true)

-- name: migrate_range_check
-- The nights of the old table: from its oldest (yesterday's at the latest: a clear of
-- yesterday's night) to tonight and the week after it (migrate_room). Every night the previous
-- release, or this one, writes in that week fits: an upgrade left interrupted here, or a
-- rollback, rejects no night of it; the legacy partition then holds them and the job's
-- partitions follow it. Added without a scan (ACCESS EXCLUSIVE for a moment, under
-- lock_timeout), then validated under SHARE UPDATE EXCLUSIVE: the attach then skips its scan.
-- Kept when an interrupted upgrade added it (the rows it admits are the old table's).
DO $check$
DECLARE
    lo date;
    hi date;
BEGIN
    IF EXISTS (SELECT 1 FROM pg_constraint
                WHERE conrelid = 'catalog.popularity_daily_views'::regclass
                  AND conname = 'popularity_daily_views_legacy_range') THEN
        RETURN;
    END IF;
    SELECT least(min(run_date), {common/today} - 1),
           greatest(max(run_date), {common/today}) + 1
               + current_setting('pin_nightly.upgrade_room')::integer
      INTO lo, hi FROM catalog.popularity_daily_views;
    EXECUTE 'ALTER TABLE catalog.popularity_daily_views ADD CONSTRAINT '
            'popularity_daily_views_legacy_range CHECK (run_date >= ' || quote_literal(lo)
            || '::date AND run_date < ' || quote_literal(hi) || '::date) NOT VALID';
END
$check$

-- name: migrate_validate
ALTER TABLE catalog.popularity_daily_views VALIDATE CONSTRAINT popularity_daily_views_legacy_range

-- name: migrate_swap
-- One transaction, every lock for a moment (lock_timeout, retried): the old table and its
-- indexes step aside under the legacy names; schema/catalog_popularity.sql then creates the
-- partitioned table (migrate_attach and migrate_ahead follow in the same transaction).
LOCK TABLE catalog.popularity_daily_views IN ACCESS EXCLUSIVE MODE;
ALTER TABLE catalog.popularity_daily_views RENAME TO popularity_daily_views_legacy;
ALTER INDEX catalog.ix_popularity_daily_unique RENAME TO popularity_daily_views_legacy_unique;
ALTER INDEX catalog.ix_popularity_daily_window RENAME TO popularity_daily_views_legacy_window;
ALTER INDEX catalog.ix_popularity_daily_run_date RENAME TO popularity_daily_views_legacy_run_date;
ALTER TABLE catalog.popularity_daily_views_legacy DROP CONSTRAINT popularity_daily_views_pkey;
ALTER TABLE catalog.popularity_daily_views_legacy
    ADD CONSTRAINT popularity_daily_views_legacy_pkey
    PRIMARY KEY USING INDEX popularity_daily_views_legacy_id_run_date;

-- name: migrate_attach
-- The old table as the partition of the nights of its validated range check (no scan; its
-- indexes become the partitions of the partitioned indexes), and the privileges it had,
-- granted again on the new table.
DO $attach$
DECLARE
    bounds text[];
    g record;
BEGIN
    SELECT regexp_matches(pg_get_constraintdef(oid),
                          '([0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]).*([0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9])')
      INTO bounds
      FROM pg_constraint
     WHERE conrelid = 'catalog.popularity_daily_views_legacy'::regclass
       AND conname = 'popularity_daily_views_legacy_range';
    EXECUTE 'ALTER TABLE catalog.popularity_daily_views ATTACH PARTITION '
            'catalog.popularity_daily_views_legacy FOR VALUES FROM ('
            || quote_literal(bounds[1]) || ') TO (' || quote_literal(bounds[2]) || ')';
    FOR g IN SELECT a.privilege_type,
                    CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END AS who
               FROM pg_class c, aclexplode(c.relacl) a LEFT JOIN pg_roles r ON r.oid = a.grantee
              WHERE c.oid = 'catalog.popularity_daily_views_legacy'::regclass
                AND a.grantee <> c.relowner LOOP
        EXECUTE 'GRANT ' || g.privilege_type || ' ON catalog.popularity_daily_views TO '
                || g.who;
    END LOOP;
    IF to_regrole('pin_catalog_job') IS NOT NULL THEN
        GRANT EXECUTE ON FUNCTION catalog.popularity_ensure_partitions(date, date),
            catalog.popularity_drop_partition(date, integer) TO pin_catalog_job;
    END IF;
END
$attach$

-- name: migrate_ahead
-- Tonight's partition and the week after it, where the legacy partition ends before them (an
-- upgrade continued days after its check was added): the job's next night, or the previous
-- release after a rollback, writes them without a further step.
SELECT catalog.popularity_ensure_partitions({common/today},
                                            {common/today} + %(nights)s::integer)

-- name: legacy_range
SELECT lower_bound, upper_bound FROM catalog.popularity_partitions()
 WHERE partition_name = 'catalog.popularity_daily_views_legacy'
