INSERT INTO pin_nightly.sweep (job, scope, family, resumable, run_id, params, started_at)
VALUES (%(job)s, %(scope)s, %(family)s, %(resumable)s, %(run_id)s, %(params)s::jsonb,
        clock_timestamp())
RETURNING sweep_id, scope, family, resumable, params, started_at
