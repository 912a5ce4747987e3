-- On a replica the run names (its own connection, pin_nightly.health): how far its replay is.
--   in_recovery    false: the connection does not lead to a replica
--   replay_bytes   WAL position replayed (bytes since 0/0), for the primary to compare
--   lag_seconds    0 when everything received is replayed, else the age of the last replayed
--                  transaction (grows while replay is stopped or behind)
SELECT pg_is_in_recovery() AS in_recovery,
       pg_wal_lsn_diff(coalesce(pg_last_wal_replay_lsn(), '0/0'), '0/0')::float8 AS replay_bytes,
       CASE WHEN pg_last_wal_receive_lsn() IS NOT DISTINCT FROM pg_last_wal_replay_lsn() THEN 0
            ELSE coalesce(extract(epoch FROM clock_timestamp()
                                             - pg_last_xact_replay_timestamp())::float8, 0)
       END AS lag_seconds
