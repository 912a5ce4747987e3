-- Partitions of catalog.popularity_daily_views (one a night, see schema/catalog_popularity.sql).
-- Named statements: pin_nightly.db.sql("catalog/<name>").

-- name: partition_layout
-- The snapshot table's layout: 'p' partitioned (this release), 'r' the previous release's
-- table, NULL absent; whether this role may change it (it is the owner, or a member of the
-- owner), and whether the partition functions exist.
SELECT c.relkind::text AS relkind,
       pg_has_role(c.relowner, 'USAGE') AS owner,
       to_regprocedure('catalog.popularity_ensure_partitions(date, date)') IS NOT NULL
           AS functions
  FROM (SELECT to_regclass('catalog.popularity_daily_views') AS oid) t
  LEFT JOIN pg_class c ON c.oid = t.oid

-- name: prune_rows
-- Retention on the previous release's table (one table, until a DBA upgrades it): one batch
-- of the snapshots past the horizon of catalog.popularity_drop_partition, oldest nights first
-- (ix_popularity_daily_run_date), deleted; how many.
WITH doomed AS (
    SELECT id FROM catalog.popularity_daily_views
     WHERE run_date < least(%(as_of)s::date, {common/today}) - (greatest(%(keep_days)s, 30) + 2)
     ORDER BY run_date LIMIT %(limit)s
), gone AS (
    DELETE FROM catalog.popularity_daily_views v USING doomed d WHERE v.id = d.id RETURNING 1
)
SELECT count(*) FROM gone

-- name: rows_past_horizon
-- What retention would delete from the previous release's table (a dry run).
SELECT count(*) FROM catalog.popularity_daily_views
 WHERE run_date < least(%(as_of)s::date, {common/today}) - (greatest(%(keep_days)s, 30) + 2)

-- name: ensure_partitions
-- Tonight's partition and the nights after it (created ahead): none is created twice.
SELECT catalog.popularity_ensure_partitions(%(from)s::date, %(through)s::date)

-- name: drop_partition
-- One partition past retention's horizon, detached and dropped (see the function).
SELECT partition_name, lower_bound, upper_bound, snapshots
  FROM catalog.popularity_drop_partition(%(as_of)s::date, %(keep_days)s)

-- name: oldest_past_horizon
-- The oldest night of a partition retention would drop (see the function), NULL when none.
SELECT min(p.lower_bound) FROM catalog.popularity_partitions() p
 WHERE p.upper_bound <= least(%(as_of)s::date, {common/today})
                        - (greatest(%(keep_days)s, 30) + 2)
