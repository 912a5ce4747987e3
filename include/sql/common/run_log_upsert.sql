INSERT INTO pin_nightly.run_log (job, run_id, status, result, started_at, finished_at)
VALUES (%(job)s, %(run_id)s, %(status)s, %(result)s::jsonb, %(started_at)s, clock_timestamp())
ON CONFLICT (job, run_id) DO UPDATE
   SET status = excluded.status, result = excluded.result,
       started_at = coalesce(excluded.started_at, pin_nightly.run_log.started_at),
       finished_at = excluded.finished_at
