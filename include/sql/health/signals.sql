-- The database's health, read before each batch outside any transaction of the job
-- (pin_nightly.health): one row. Values a role without pg_read_all_stats cannot see read NULL
-- (can_read_stats says so), and a NULL signal never pauses.
--   wal_bytes             WAL position (bytes since 0/0): the job turns two readings into a rate
--   replica_lag_seconds   the worst replay_lag of a streaming replica; 0 for a replica that has
--                         replayed everything (replay_lag keeps its last value until more WAL
--                         flows, and does not grow while replay is stopped and no WAL flows)
--   replica_lag_bytes     the most WAL a replica has received or not but not replayed yet
--   vacuum                a VACUUM (autovacuum or manual) running on one of %(tables)s in this
--                         database: "<table> pid <pid> <phase>"
--   archive_backlog       completed WAL segments not archived yet, when archive_mode is on
--   seconds_left          until the range's share of the run's budget is spent (NULL: the
--                         lease is no longer this run's)
WITH replicas AS (
    SELECT coalesce(nullif(application_name, ''), 'pid ' || pid)
               || coalesce(' ' || host(client_addr), ' (local)') AS replica,
           pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn)::float8 AS lag_bytes,
           CASE WHEN replay_lsn >= pg_current_wal_lsn() THEN 0
                ELSE coalesce(extract(epoch FROM replay_lag)::float8, 0) END AS lag_seconds
      FROM pg_stat_replication
     WHERE replay_lsn IS NOT NULL
), segment AS (
    SELECT setting::bigint AS size FROM pg_settings WHERE name = 'wal_segment_size'
)
SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::float8 AS wal_bytes,
       (SELECT max(lag_seconds) FROM replicas) AS replica_lag_seconds,
       (SELECT replica FROM replicas ORDER BY lag_seconds DESC LIMIT 1) AS replica_lag_seconds_of,
       (SELECT max(lag_bytes) FROM replicas) AS replica_lag_bytes,
       (SELECT replica FROM replicas ORDER BY lag_bytes DESC LIMIT 1) AS replica_lag_bytes_of,
       -- a partitioned table's VACUUM runs on its partitions: named by the table written (the
       -- partition tree of a plain table is empty: the table itself is added)
       (SELECT string_agg(w.t || ' pid ' || v.pid || ' ' || v.phase, ', ')
          FROM pg_stat_progress_vacuum v
          JOIN (SELECT t, r.relid FROM unnest(%(tables)s::text[]) AS t,
                       LATERAL (SELECT to_regclass(t) AS relid
                                UNION SELECT p.relid FROM pg_partition_tree(to_regclass(t)) p)
                       AS r) w ON w.relid = v.relid
         WHERE v.datname = current_database()) AS vacuum,
       CASE WHEN current_setting('archive_mode') <> 'off' THEN (
           SELECT (('x' || substr(cur, 9, 8))::bit(32)::bigint - ('x' || substr(done, 9, 8))::bit(32)::bigint)
                      * (4294967296 / s.size)
                  + ('x' || substr(cur, 17, 8))::bit(32)::bigint
                  - ('x' || substr(done, 17, 8))::bit(32)::bigint - 1
             FROM (SELECT pg_walfile_name(pg_current_wal_lsn()) AS cur,
                          left(last_archived_wal, 24) AS done
                     FROM pg_stat_archiver
                    WHERE last_archived_wal ~ '^[0-9A-F]{24}') AS a, segment AS s)
       END AS archive_backlog,
       (SELECT extract(epoch FROM {common/share_deadline} - clock_timestamp())::float8
          FROM pin_nightly.job_lease
         WHERE lock_key = %(lock_key)s AND token = %(token)s) AS seconds_left,
       pg_has_role('pg_read_all_stats', 'USAGE') AS can_read_stats
