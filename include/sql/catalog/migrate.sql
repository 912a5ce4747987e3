-- The online upgrade of the previous release's catalog.popularity_daily_views (one table) to
-- the partitioned layout of schema/catalog_popularity.sql, step by step
-- (pin_nightly.partitions.migrate). Nothing here locks a card table. The old table becomes
-- one range partition, popularity_daily_views_legacy, covering [its oldest night, the day
-- after today) so that no row moves; retention drops it whole once all its nights are past
-- the horizon.

-- name: migrate_facts
-- The old table's nights, the bound of the legacy partition (the day after the newest of
-- today and the newest night: every night written before the upgrade fits), the range check
-- and the index an interrupted upgrade may have left.
SELECT (SELECT min(run_date) FROM catalog.popularity_daily_views) AS oldest,
       greatest((SELECT max(run_date) FROM catalog.popularity_daily_views),
                (now() AT TIME ZONE 'UTC')::date) + 1 AS bound,
       (SELECT pg_get_constraintdef(oid) FROM pg_constraint
         WHERE conrelid = 'catalog.popularity_daily_views'::regclass
           AND conname = 'popularity_daily_views_legacy_range') AS range_check,
       (SELECT indisvalid FROM pg_index
         WHERE indexrelid = to_regclass('catalog.popularity_daily_views_legacy_id_run_date'))
           AS key_valid,
       (SELECT indisvalid FROM pg_index
         WHERE indexrelid = to_regclass('catalog.ix_popularity_daily_run_date'))
           AS run_date_valid

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

-- name: migrate_range_check
-- The nights of the old table: [its oldest night, the day after the newest of today and its
-- newest night), so that every night written before the upgrade fits. Added without a scan
-- (ACCESS EXCLUSIVE for a moment, under lock_timeout), then validated under SHARE UPDATE
-- EXCLUSIVE: the attach below then skips its scan. Kept when an interrupted upgrade added it.
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
    SELECT min(run_date), greatest(max(run_date), (now() AT TIME ZONE 'UTC')::date) + 1
      INTO lo, hi FROM catalog.popularity_daily_views;
    lo := coalesce(lo, hi - 1);
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
-- partitioned table (migrate_attach follows in the same transaction).
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

-- name: legacy_range
SELECT lower_bound, upper_bound FROM catalog.popularity_partitions()
 WHERE partition_name = 'catalog.popularity_daily_views_legacy'
