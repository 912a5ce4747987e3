-- Last statement of a batch, in the batch's transaction while it holds its row locks: the
-- sessions waiting for a lock this backend holds (how many, and the longest wait in seconds).
-- pg_blocking_pids() is asked only about the sessions that wait for a lock at all.
WITH waiting AS MATERIALIZED (
    SELECT pid, min(waitstart) AS since
      FROM pg_locks
     WHERE NOT granted AND pid <> pg_backend_pid()
     GROUP BY pid
)
SELECT count(*)::int AS waiters,
       coalesce(extract(epoch FROM clock_timestamp() - min(since))::float8, 0) AS longest_wait_s
  FROM waiting
 WHERE pg_backend_pid() = ANY (pg_blocking_pids(pid))
