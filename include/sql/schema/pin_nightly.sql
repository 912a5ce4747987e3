-- Job-owned state of pin-nightly: lease (single-flight lock), sweeps and their keyset ranges
-- (checkpoints), the run log and the news drift records.
-- Idempotent: the DAGs apply it when the schema is absent; DBAs may apply it themselves.
CREATE SCHEMA IF NOT EXISTS pin_nightly;

-- Distributed lock with a TTL. One row per lock key; the holder renews it while it works.
-- token is a fencing token: it changes on every acquisition, and every batch checks it.
CREATE SEQUENCE IF NOT EXISTS pin_nightly.lease_token_seq;
CREATE TABLE IF NOT EXISTS pin_nightly.job_lease (
    lock_key        text        PRIMARY KEY,
    holder          text        NOT NULL,
    token           bigint      NOT NULL,
    ttl             interval    NOT NULL,
    acquired_at     timestamptz NOT NULL,
    expires_at      timestamptz NOT NULL,
    run_deadline_at timestamptz NOT NULL
);

-- A sweep is one pass of a job over its keyset (a scope); it may span several runs when a run
-- stops at its time budget. Resumable sweeps are adopted by the next run of the same scope.
CREATE TABLE IF NOT EXISTS pin_nightly.sweep (
    sweep_id     bigserial   PRIMARY KEY,
    job          text        NOT NULL,
    scope        text        NOT NULL,
    family       text        NOT NULL,
    resumable    boolean     NOT NULL,
    status       text        NOT NULL DEFAULT 'open'
                 CHECK (status IN ('open', 'done', 'abandoned')),
    run_id       text        NOT NULL,
    params       jsonb       NOT NULL DEFAULT '{}'::jsonb,
    started_at   timestamptz NOT NULL DEFAULT now(),
    completed_at timestamptz
);
CREATE UNIQUE INDEX IF NOT EXISTS sweep_one_open_per_scope
    ON pin_nightly.sweep (job, scope) WHERE status = 'open' AND resumable;
CREATE INDEX IF NOT EXISTS sweep_job_completed
    ON pin_nightly.sweep (job, completed_at DESC) WHERE status = 'done';

-- Contiguous keyset ranges (lower_id, upper_id] of a sweep; NULL bounds are open ends.
-- cursor_id is the checkpoint: the last id handled, advanced in the same transaction as the
-- batch's writes. Counters belong to the run in run_id (reset when another run adopts the range):
-- rows_processed = rows checked, rows_changed = rows corrected/updated, rows_written = extra
-- rows written (popularity snapshots), skipped_locked = rows left because locked.
CREATE TABLE IF NOT EXISTS pin_nightly.sweep_range (
    sweep_id        bigint      NOT NULL REFERENCES pin_nightly.sweep ON DELETE CASCADE,
    range_no        integer     NOT NULL,
    lower_id        uuid,
    upper_id        uuid,
    planned_rows    bigint      NOT NULL DEFAULT 0,
    cursor_id       uuid,
    status          text        NOT NULL DEFAULT 'pending'
                    CHECK (status IN ('pending', 'done')),
    run_id          text        NOT NULL,
    rows_processed  bigint      NOT NULL DEFAULT 0,
    rows_changed    bigint      NOT NULL DEFAULT 0,
    batches         integer     NOT NULL DEFAULT 0,
    skipped_locked  integer     NOT NULL DEFAULT 0,
    item_errors     integer     NOT NULL DEFAULT 0,
    rows_written    bigint      NOT NULL DEFAULT 0,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (sweep_id, range_no)
);

-- The owner of a sweep and of its ranges is the acquisition that works them: the lease holder
-- of a run (its dag id, run id and the tag its validate_options drew), not the run id alone,
-- which every deployment that fires a slot gives its run. Added to tables created before owners
-- existed; their rows take the run id as owner (no open work of theirs can match a new holder).
ALTER TABLE pin_nightly.sweep ADD COLUMN IF NOT EXISTS owner text;
UPDATE pin_nightly.sweep SET owner = run_id WHERE owner IS NULL;
ALTER TABLE pin_nightly.sweep ALTER COLUMN owner SET NOT NULL;
ALTER TABLE pin_nightly.sweep_range ADD COLUMN IF NOT EXISTS owner text;
UPDATE pin_nightly.sweep_range SET owner = run_id WHERE owner IS NULL;
ALTER TABLE pin_nightly.sweep_range ALTER COLUMN owner SET NOT NULL;
-- Rows a batch could not write (a domain trigger or a constraint rejected them): the batch
-- wrote the others and the range went on; the row is tried again by the next run.
CREATE TABLE IF NOT EXISTS pin_nightly.item_error (
    job         text        NOT NULL,
    run_id      text        NOT NULL,
    sweep_id    bigint      NOT NULL,
    item_id     uuid        NOT NULL,
    sqlstate    text,
    message     text        NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS item_error_recorded ON pin_nightly.item_error (job, recorded_at);
-- the row's kind where a job has several (catalog: the spec's CardKind), else null
ALTER TABLE pin_nightly.item_error ADD COLUMN IF NOT EXISTS item_kind text;
-- the row's xmin after its failed write: the next runs hold the row back while it is unchanged
ALTER TABLE pin_nightly.item_error ADD COLUMN IF NOT EXISTS row_version text;

-- A range may start inside itself (a sweep that resumes where the previous night's stopped):
-- it works (wrap_at, upper_id], then wraps (wrapped) to (lower_id, wrap_at].
ALTER TABLE pin_nightly.sweep_range ADD COLUMN IF NOT EXISTS wrap_at uuid;
ALTER TABLE pin_nightly.sweep_range ADD COLUMN IF NOT EXISTS wrapped boolean NOT NULL DEFAULT false;

-- the open sweeps of an owner (the planner looks them up)
CREATE INDEX IF NOT EXISTS sweep_open_owner
    ON pin_nightly.sweep (job, owner) WHERE status = 'open';

-- One row per Airflow run: its result, as the summary task computed it.
CREATE TABLE IF NOT EXISTS pin_nightly.run_log (
    job         text        NOT NULL,
    run_id      text        NOT NULL,
    status      text        NOT NULL,
    result      jsonb       NOT NULL,
    started_at  timestamptz,
    finished_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job, run_id)
);

-- news_comment_reconcile: every correction (or, in a dry run, every drift found).
CREATE TABLE IF NOT EXISTS pin_nightly.news_drift (
    sweep_id    bigint      NOT NULL,
    run_id      text        NOT NULL,
    post_id     uuid        NOT NULL,
    count_from  integer     NOT NULL,
    count_to    integer     NOT NULL,
    dry_run     boolean     NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS news_drift_run ON pin_nightly.news_drift (run_id);

-- news_comment_reconcile, DailyWindow: the candidate posts of a window sweep, materialized once
-- from the comments' updated_at index so that a resumed sweep sees the same set. Each run's
-- summary deletes the candidates of sweeps that can no longer run (news/prune_candidates.sql).
-- No foreign key to pin_nightly.sweep: checking it per inserted row cost a third of the time
-- of filling the table (76k candidates a night at the specs' volume).
CREATE TABLE IF NOT EXISTS pin_nightly.news_window_candidate (
    sweep_id bigint NOT NULL,
    post_id  uuid   NOT NULL,
    PRIMARY KEY (sweep_id, post_id)
);

-- news_comment_reconcile: posts that stayed locked by the hot path through a run; the next
-- run of any scope checks them first.
CREATE TABLE IF NOT EXISTS pin_nightly.news_skipped_post (
    post_id    uuid        PRIMARY KEY,
    skipped_at timestamptz NOT NULL DEFAULT now()
);

-- catalog_popularity_recompute: the score a card had when the job first snapshotted it, while
-- the job's history did not yet cover the window (a platform's first nights with the job). Until
-- the card's window is covered (as_of > as_of_date - window_days), its score is the formula over
-- its snapshots plus this score decayed from as_of: a first night keeps the platform's scores
-- instead of writing 0 (docs/design.md#first-nights). Pruned with the snapshots' horizon.
CREATE TABLE IF NOT EXISTS pin_nightly.popularity_inherited (
    card_kind varchar(16)   NOT NULL,
    card_id   uuid          NOT NULL,
    score     numeric(12,4) NOT NULL,
    as_of     date          NOT NULL,
    PRIMARY KEY (card_kind, card_id)
);

-- catalog_popularity_recompute: cards still locked by others after the end-of-range retry,
-- which got no snapshot and no score that night (as_of). Forgotten when a later batch writes
-- the card, or past the snapshots' horizon; counted by the unscored-cards gauge.
CREATE TABLE IF NOT EXISTS pin_nightly.popularity_skipped_card (
    card_kind  varchar(16) NOT NULL,
    card_id    uuid        NOT NULL,
    as_of      date        NOT NULL,
    skipped_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (card_kind, card_id)
);

-- The signals each acquisition sent (metrics, alerts), written by its first summary: a summary
-- run again (its task cleared) sends no counter or alert twice and re-sends the same gauges.
-- run_at is the instant the run is about (its logical date, or when it was triggered);
-- work_done_at is when the acquisition's work completed (the last-success time); drift_through
-- is the instant up to which its summary counted the corrections in news_drift (the next summary
-- counts from there, so a correction is counted once, even when its run died before its summary).
CREATE TABLE IF NOT EXISTS pin_nightly.run_signal (
    job           text        NOT NULL,
    owner         text        NOT NULL,
    run_id        text        NOT NULL,
    run_at        timestamptz NOT NULL,
    nightly       boolean     NOT NULL,
    work_done_at  timestamptz NOT NULL,
    drift_through timestamptz NOT NULL,
    signals       jsonb       NOT NULL,
    emitted_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (job, owner)
);
CREATE INDEX IF NOT EXISTS run_signal_through ON pin_nightly.run_signal (job, drift_through);
-- the summaries count the corrections recorded since the previous one
CREATE INDEX IF NOT EXISTS news_drift_recorded ON pin_nightly.news_drift (recorded_at);

CREATE INDEX IF NOT EXISTS item_error_item ON pin_nightly.item_error (job, item_id);

-- What a range paused for, from its pacing (signal -> pauses; "operator": the sweep paused from
-- the console) and for how long in all.
ALTER TABLE pin_nightly.sweep_range ADD COLUMN IF NOT EXISTS pauses jsonb NOT NULL DEFAULT '{}';
ALTER TABLE pin_nightly.sweep_range ADD COLUMN IF NOT EXISTS paused_ms bigint NOT NULL DEFAULT 0;

-- Controls over an open sweep, set from the console and read by each of its ranges before each
-- batch (pin_nightly.controls): paused, a batch size and pacing limits (params) in place of the
-- run's own.
CREATE TABLE IF NOT EXISTS pin_nightly.sweep_control (
    sweep_id    bigint      PRIMARY KEY REFERENCES pin_nightly.sweep ON DELETE CASCADE,
    paused      boolean     NOT NULL DEFAULT false,
    settings    jsonb       NOT NULL DEFAULT '{}',
    updated_by  text        NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
-- Every control given: who, when, what (the summary of a run that worked the sweep lists them).
CREATE TABLE IF NOT EXISTS pin_nightly.control_event (
    sweep_id    bigint      NOT NULL REFERENCES pin_nightly.sweep ON DELETE CASCADE,
    action      text        NOT NULL,
    value       jsonb       NOT NULL DEFAULT '{}',
    given_by    text        NOT NULL,
    given_at    timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- The last statement of this file: the jobs probe for this index (pin_nightly.jobs.STATE_DDL),
-- and a schema without it is brought up to date by running the whole file again. A release
-- that adds to the file moves the probe to what it adds last.
CREATE INDEX IF NOT EXISTS control_event_sweep ON pin_nightly.control_event (sweep_id, given_at);
