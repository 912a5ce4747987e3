"""news_comment_reconcile end to end: real Airflow (dag.test) on a real PostgreSQL."""

from __future__ import annotations

import os
import signal
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from tests.helpers import assert_ok, when
from tools.rundag import run_count, run_dag, xcom_keys

DAG = "news_comment_reconcile"
FULL = {"scope": "FullSweep"}


def run(conf=None, **kw):
    return run_dag(DAG, conf, **kw)


def test_empty_database_is_a_noop_success(news_db):
    s = assert_ok(run(FULL))
    assert s["posts_reconciled"] == 0
    assert s["drift_corrected"] == 0
    assert s["backlog_remaining"] is False
    assert s["status"] == "success"


def test_all_counters_correct_is_a_noop(news_db):
    ids = news_db.posts(20, visible=2)
    before = news_db.snapshot()
    s = assert_ok(run(FULL))
    assert (s["posts_reconciled"], s["drift_corrected"]) == (20, 0)
    assert news_db.snapshot() == before
    assert s["last_post_id"] == max(ids)


def test_a_task_stores_one_xcom_and_the_summary_keeps_its_keys(news_db):
    """The options, the lease, the plan and each range's result are one XCom each (each key
    would be a metadata row and an execution-API call of its own); the summary also keeps its
    result's keys, which its XCom view lists."""
    news_db.posts(20, visible=1)
    r = run({**FULL, "batch_size": 5, "max_ranges": 4})
    s = assert_ok(r)
    keys = xcom_keys(DAG, r["run_id"])
    ranges = sorted(k for k in keys if k.startswith("reconcile_range["))
    assert len(ranges) == 4, keys
    for task in ("validate_options", "acquire_lease", "plan_ranges", *ranges):
        assert keys[task] == {"return_value"}, (task, keys[task])
    assert keys["summarize"] == {"return_value", *s}


def test_drift_is_corrected_then_a_second_run_corrects_nothing(news_db):
    drifted = news_db.post(count=5, visible=3, hidden=2, deleted=1)
    right = news_db.post(count=2, visible=2)
    old_updated = news_db.post_row(right)[3]
    s = assert_ok(run(FULL))
    assert news_db.count(drifted) == 3
    assert s["drift_corrected"] == 1 and s["posts_reconciled"] == 2
    assert news_db.post_row(right)[3] == old_updated  # untouched
    pid, status, count, updated = news_db.post_row(drifted)
    assert status == "Published" and updated > old_updated
    assert news_db.q(
        "SELECT post_id::text, count_from, count_to, dry_run FROM pin_nightly.news_drift"
    ) == [(drifted, 5, 3, False)]
    before = news_db.snapshot()
    s2 = assert_ok(run(FULL))
    assert s2["drift_corrected"] == 0 and s2["posts_reconciled"] == 2
    assert news_db.snapshot() == before
    log = news_db.q(
        "SELECT status, (result->>'drift_corrected')::int FROM pin_nightly.run_log "
        "ORDER BY finished_at"
    )
    assert log == [("success", 1), ("success", 0)]


def test_hidden_and_deleted_comments_are_not_counted(news_db):
    only_hidden = news_db.post(count=4, visible=0, hidden=3, deleted=1)
    mixed = news_db.post(count=0, visible=1, hidden=5, deleted=5)
    assert_ok(run(FULL))
    assert news_db.count(only_hidden) == 0
    assert news_db.count(mixed) == 1


def test_archived_posts_are_never_touched(news_db):
    archived = news_db.post(count=9, visible=1, status="Archived")
    null_status = news_db.post(count=9, visible=1, status=None)
    before = news_db.post_row(archived)
    s = assert_ok(run(FULL))
    assert news_db.post_row(archived) == before
    assert news_db.count(null_status) == 1
    assert s["posts_reconciled"] == 1
    # not even by a targeted repair naming it
    assert_ok(run({"post_ids": [archived]}))
    assert news_db.post_row(archived) == before


def _open_hot_path_comment(db, pid: str):
    """A hot-path transaction left open: a new visible comment and the counter +1."""
    hot_path = psycopg.connect(db.dsn)
    hot_path.execute(
        "INSERT INTO news.comments (id, post_id, status, created_at, updated_at) "
        "VALUES (gen_random_uuid(), %s, 'Visible', now(), now())",
        (pid,),
    )
    hot_path.execute(
        "UPDATE news.posts SET comments_count = comments_count + 1 WHERE id = %s", (pid,)
    )
    return hot_path


def test_child_rows_referencing_the_locked_posts_are_inserted_without_waiting(news_db):
    """The batch locks its posts FOR NO KEY UPDATE (it changes no key): an insert into a table
    that references news.posts by foreign key takes FOR KEY SHARE on the post, which FOR
    UPDATE would block until the batch commits. Here a batch of 10 drifted posts is held in
    flight (a trigger waits on the 6th post's update for an advisory lock the test holds):
    every post is locked (FOR UPDATE NOWAIT fails on each), yet a like of each post is
    inserted at once."""
    import threading
    import time

    from tests.helpers import ADVISORY_KEY, gate_waiter, install_gate, wait_for

    news_db.q(
        "CREATE TABLE news.post_likes (id bigserial PRIMARY KEY, "
        "post_id uuid NOT NULL REFERENCES news.posts (id))"
    )
    ids = news_db.posts(10, drift_every=1)
    install_gate(news_db, "news.posts", ids[5])
    gate = psycopg.connect(news_db.dsn, autocommit=True)
    gate.execute("SELECT pg_advisory_lock(%s)", (ADVISORY_KEY,))
    seen: dict = {"locked": [], "insert_s": [], "error": None}

    def while_the_batch_holds_its_locks():
        try:
            wait_for(lambda: gate_waiter(news_db), timeout=120, what="the batch at the gate")
            with psycopg.connect(news_db.dsn, autocommit=True) as conn:
                conn.execute("SET lock_timeout = '3s'")
                for p in ids:
                    try:
                        conn.execute(
                            "SELECT 1 FROM news.posts WHERE id = %s FOR UPDATE NOWAIT", (p,)
                        )
                    except psycopg.errors.LockNotAvailable:
                        seen["locked"].append(p)
                    t0 = time.monotonic()
                    conn.execute("INSERT INTO news.post_likes (post_id) VALUES (%s)", (p,))
                    seen["insert_s"].append(time.monotonic() - t0)
        except Exception as exc:  # noqa: BLE001 - reported below
            seen["error"] = repr(exc)
        finally:
            gate.execute("SELECT pg_advisory_unlock(%s)", (ADVISORY_KEY,))

    t = threading.Thread(target=while_the_batch_holds_its_locks)
    t.start()
    try:
        s = assert_ok(run({**FULL, "batch_size": 10, "max_ranges": 1}))
    finally:
        t.join(150)
        gate.close()
    assert seen["error"] is None, seen["error"]
    assert seen["locked"] == ids  # the batch held every post's row lock during the inserts
    assert len(seen["insert_s"]) == 10 and max(seen["insert_s"]) < 1, seen["insert_s"]
    assert news_db.one("SELECT count(*) FROM news.post_likes") == 10
    assert s["drift_corrected"] == 10 and news_db.drifted_posts() == 0


def test_locked_post_is_skipped_and_the_hot_path_increment_is_not_lost(news_db):
    hot = news_db.post(count=5, visible=3)  # drifted, and about to be written by the hot path
    other = news_db.post(count=7, visible=1)
    hot_path = _open_hot_path_comment(news_db, hot)
    try:
        s = assert_ok(run(FULL))  # the hot-path transaction is still open
    finally:
        hot_path.commit()
        hot_path.close()
    assert s["posts_skipped_locked"] == 1
    assert s["drift_corrected"] == 1 and s["posts_reconciled"] == 1
    assert news_db.count(other) == 1
    assert news_db.count(hot) == 6  # the hot path's +1 landed on the untouched counter
    assert news_db.q("SELECT post_id::text FROM pin_nightly.news_skipped_post") == [(hot,)]
    # the next run (a DailyWindow, even with no fresh comments) takes the skipped post
    s2 = assert_ok(run({"scope": "DailyWindow"}))
    assert news_db.count(hot) == 4
    assert s2["drift_corrected"] == 1
    assert news_db.q("SELECT count(*) FROM pin_nightly.news_skipped_post") == [(0,)]


def test_a_lock_released_before_the_end_of_the_range_is_retried(news_db):
    hot = news_db.post(count=5, visible=3)
    news_db.posts(30, visible=1)
    hot_path = psycopg.connect(news_db.dsn)
    hot_path.execute("SELECT 1 FROM news.posts WHERE id = %s FOR UPDATE", (hot,))
    # release the row lock right after the first batch has skipped it
    when(
        lambda: (
            news_db.one("SELECT coalesce(sum(skipped_locked), 0) FROM pin_nightly.sweep_range") > 0
        ),
        hot_path.commit,
    )
    s = assert_ok(run({**FULL, "batch_size": 5}))
    hot_path.close()
    assert news_db.count(hot) == 3
    assert s["posts_skipped_locked"] == 0 and s["posts_reconciled"] == 31


@pytest.mark.parametrize("scope", ["FullSweep", "DailyWindow"])
def test_a_correct_post_held_by_the_hot_path_is_verified_without_its_lock(news_db, scope):
    """Only posts whose counter looks wrong are locked: a correct post that the hot path is
    writing right now (comment and counter in one open transaction) is verified from the
    committed state, neither skipped nor written, and the hot path's change lands intact."""
    now = datetime.now(UTC)
    busy = news_db.post(count=4, visible=4, comments_at=now - timedelta(hours=1))
    drifted = news_db.post(count=9, visible=2, comments_at=now - timedelta(hours=1))
    before = news_db.post_row(busy)
    hot_path = _open_hot_path_comment(news_db, busy)
    try:
        s = assert_ok(run({"scope": scope}))  # the hot-path transaction is still open
        assert news_db.post_row(busy) == before  # the committed row, untouched by the run
    finally:
        hot_path.commit()
        hot_path.close()
    assert (s["posts_reconciled"], s["drift_corrected"], s["posts_skipped_locked"]) == (2, 1, 0)
    assert news_db.count(busy) == 5
    assert news_db.count(drifted) == 2
    assert news_db.q("SELECT post_id::text FROM pin_nightly.news_drift") == [(drifted,)]
    assert news_db.q("SELECT count(*) FROM pin_nightly.news_skipped_post") == [(0,)]


def test_max_run_duration_interrupts_and_the_next_run_resumes_from_the_cursor(news_db):
    ids = news_db.posts(120, drift_every=3)
    # end the run's time budget once a few batches have committed (as if 20 minutes passed)
    when(
        lambda: news_db.one("SELECT coalesce(sum(batches), 0) FROM pin_nightly.sweep_range") >= 3,
        lambda: news_db.q("UPDATE pin_nightly.job_lease SET run_deadline_at = now()"),
    )
    s1 = assert_ok(run({**FULL, "batch_size": 2, "max_ranges": 1}))
    assert s1["backlog_remaining"] is True and s1["status"] == "backlog_remaining"
    done = s1["posts_reconciled"]
    assert 3 * 2 <= done < 120
    cursor = news_db.one("SELECT cursor_id::text FROM pin_nightly.sweep_range")
    assert cursor == s1["last_post_id"]
    # posts after the cursor were not touched yet
    assert all(news_db.count(p) == 5 for p in ids[done:] if ids.index(p) % 3 == 0)
    s2 = assert_ok(run({**FULL, "batch_size": 2, "max_ranges": 1}))
    assert s2["backlog_remaining"] is False
    assert s2["sweep_id"] == s1["sweep_id"]  # the same sweep, resumed
    assert done + s2["posts_reconciled"] == 120  # nothing read twice
    assert s1["drift_corrected"] + s2["drift_corrected"] == 40
    assert news_db.drifted_posts() == 0
    # each drifted post was corrected exactly once
    assert news_db.one("SELECT count(DISTINCT post_id) = count(*) FROM pin_nightly.news_drift")


def test_second_run_while_the_lease_is_held_does_nothing(news_db, capfd, caplog):
    drifted = news_db.post(count=5, visible=3)
    assert_ok(run({"post_ids": [drifted], "dry_run": True}))  # creates the job's tables
    news_db.q(
        "INSERT INTO pin_nightly.job_lease (lock_key, holder, token, ttl, acquired_at, "
        "expires_at, run_deadline_at) VALUES ('Pin:lock:job:scheduled:news-comment-"
        "reconcile', 'other-deployment/run-1', 999, '30 min', now(), "
        "now() + interval '10 min', now() + interval '5 min')"
    )
    capfd.readouterr()
    r = run(FULL)
    out = capfd.readouterr()
    assert r["state"] == "success"
    assert r["tasks"]["reconcile_range"] == "skipped"  # no range planned
    assert r["summary"]["status"] == "skipped, lock held"
    assert r["note"] == (
        "skipped, lock held: another run of the job held its lease; nothing was done"
    )
    assert "skipped, lock held" in out.out + out.err + caplog.text
    assert news_db.count(drifted) == 5
    assert news_db.q("SELECT holder FROM pin_nightly.job_lease") == [("other-deployment/run-1",)]
    # once the other holder's lease has expired, a run proceeds
    news_db.q("UPDATE pin_nightly.job_lease SET expires_at = now() - interval '1 s'")
    assert_ok(run(FULL))
    assert news_db.count(drifted) == 3
    assert news_db.q("SELECT count(*) FROM pin_nightly.job_lease") == [(0,)]


def test_cancellation_between_batches_keeps_what_was_committed(news_db):
    ids = news_db.posts(80, drift_every=1)
    # SIGTERM (the host stopping the task) once two batches are committed
    when(
        lambda: news_db.one("SELECT coalesce(sum(batches), 0) FROM pin_nightly.sweep_range") >= 2,
        lambda: os.kill(os.getpid(), signal.SIGTERM),
    )
    r = run({**FULL, "batch_size": 4, "max_ranges": 1})
    assert r["state"] == "failed"
    assert r["tasks"]["reconcile_range[0]"] == "failed"
    assert r["tasks"]["release_lease"] == "success"  # the teardown still released the lease
    cursor, batches, processed = news_db.q(
        "SELECT cursor_id::text, batches, rows_processed FROM pin_nightly.sweep_range"
    )[0]
    assert batches >= 2 and processed == batches * 4
    fixed = [p for p in ids if news_db.count(p) == 2]
    assert fixed == [p for p in ids if p <= cursor]  # whole batches, up to the cursor
    assert news_db.q("SELECT count(*) FROM pin_nightly.job_lease") == [(0,)]
    s = assert_ok(run({**FULL, "batch_size": 4, "max_ranges": 1}))
    assert s["posts_reconciled"] == 80 - processed
    assert news_db.drifted_posts() == 0


def test_dry_run_finds_drift_and_writes_nothing(news_db):
    news_db.posts(10, drift_every=2)
    before = news_db.snapshot()
    s = assert_ok(run({**FULL, "dry_run": True}))
    assert s["drift_found"] == 5 and s["drift_corrected"] == 0 and s["dry_run"] is True
    assert news_db.snapshot() == before
    assert news_db.one("SELECT count(*) FROM pin_nightly.news_drift WHERE dry_run") == 5
    # a dry run is not a checkpoint: the real run that follows sweeps everything
    s2 = assert_ok(run(FULL))
    assert s2["drift_corrected"] == 5


def test_post_ids_repairs_only_those_posts(news_db):
    a = news_db.post(count=5, visible=3)
    b = news_db.post(count=6, visible=1)
    c = news_db.post(count=9, visible=2)
    missing = "01900000-0000-7000-8000-000000000000"
    s = assert_ok(run({"post_ids": [a, c.upper(), missing]}))
    assert (news_db.count(a), news_db.count(b), news_db.count(c)) == (3, 6, 2)
    assert s["scope"] == "Targeted" and s["drift_corrected"] == 2 and s["posts_reconciled"] == 2


def _comment_change(db, pid: str, at: datetime) -> None:
    db.q(
        "UPDATE news.comments SET status = 'HiddenByModerator', updated_at = %s "
        "WHERE id = (SELECT id FROM news.comments WHERE post_id = %s AND status = 'Visible' "
        "LIMIT 1)",
        at,
        pid,
    )


def test_daily_window_sees_recent_activity_only(news_db):
    now = datetime.now(UTC)
    active = news_db.post(count=3, visible=3, comments_at=now - timedelta(days=30))
    quiet = news_db.post(count=9, visible=3, comments_at=now - timedelta(days=30))
    _comment_change(news_db, active, now - timedelta(hours=2))  # hidden, counter not decremented
    s = assert_ok(run({"scope": "DailyWindow"}))
    assert s["scope"] == "DailyWindow" and s["posts_reconciled"] == 1
    assert news_db.count(active) == 2
    assert news_db.count(quiet) == 9  # quiet drift is the FullSweep's job


def test_window_candidates_are_kept_until_their_sweep_is_finished(news_db):
    now = datetime.now(UTC)
    ids = [
        news_db.post(count=3, visible=3, comments_at=now - timedelta(days=30)) for _ in range(12)
    ]
    for pid in ids:
        _comment_change(news_db, pid, now - timedelta(hours=1))
    candidates = "SELECT count(*) FROM pin_nightly.news_window_candidate"
    # a time budget that is over before the first batch: the sweep stays open
    out_of_time = {"max_run_duration_minutes": 0.0001}
    conf = {"scope": "DailyWindow", "batch_size": 5, "max_ranges": 1}
    s1 = assert_ok(run({**conf, **out_of_time}))
    assert s1["backlog_remaining"] is True and s1["posts_reconciled"] == 0
    assert news_db.one(candidates) == 12  # the open sweep still needs them
    # the next window covers what the unfinished one had left: that one is abandoned, and the
    # candidates of both are gone once the run is done
    s2 = assert_ok(run(conf))
    assert s2["sweep_id"] != s1["sweep_id"] and s2["backlog_remaining"] is False
    assert s2["posts_reconciled"] == 12
    assert all(news_db.count(p) == 2 for p in ids)
    assert news_db.q(
        "SELECT status FROM pin_nightly.sweep WHERE sweep_id = %s", s1["sweep_id"]
    ) == [("abandoned",)]
    assert news_db.one(candidates) == 0
    # a dry run's sweep cannot be adopted: the next run drops what it leaves
    s3 = assert_ok(run({**conf, **out_of_time, "dry_run": True}))
    assert s3["backlog_remaining"] is True and s3["sweep_id"] != s1["sweep_id"]
    assert news_db.one(candidates) == 12
    assert_ok(run({"scope": "FullSweep"}))
    assert news_db.one(candidates) == 0


def test_a_missed_night_is_caught_by_the_next_window_run(news_db):
    now = datetime.now(UTC)
    p1 = news_db.post(count=3, visible=3, comments_at=now - timedelta(days=30))
    p2 = news_db.post(count=3, visible=3, comments_at=now - timedelta(days=30))
    assert_ok(run({"scope": "DailyWindow"}))
    # the last completed sweep was three nights ago; two nights were missed
    news_db.q(
        "UPDATE pin_nightly.sweep SET started_at = now() - interval '74 hours', "
        "completed_at = now() - interval '73 hours'"
    )
    _comment_change(news_db, p1, now - timedelta(hours=50))  # older than the 26 h look-back
    _comment_change(news_db, p2, now - timedelta(hours=80))  # before the last sweep: covered
    s = assert_ok(run({"scope": "DailyWindow"}))
    assert news_db.count(p1) == 2
    assert news_db.count(p2) == 3
    assert s["posts_reconciled"] == 1


def test_auto_scope_is_full_sweep_on_sunday_nights_in_moscow(news_db):
    quiet = news_db.post(count=9, visible=3, comments_at=datetime(2026, 1, 1, tzinfo=UTC))
    # Saturday 2026-11-28 03:00 MSK = 00:00 UTC: a window night
    s = assert_ok(run({}, logical_date=datetime(2026, 11, 28, 0, 0, tzinfo=UTC)))
    assert s["scope"] == "DailyWindow" and news_db.count(quiet) == 9
    # Sunday 2026-11-29 03:00 MSK = Sunday 00:00 UTC: the weekly full sweep
    s = assert_ok(run({}, logical_date=datetime(2026, 11, 29, 0, 0, tzinfo=UTC)))
    assert s["scope"] == "FullSweep" and news_db.count(quiet) == 3


def test_clearing_a_failed_range_resumes_it_from_its_cursor(news_db):
    ids = news_db.posts(60, drift_every=1)
    poison = ids[45]
    news_db.fail_updates_of(poison)  # an infrastructure failure on one post of the last range
    logical = datetime(2026, 11, 25, 9, 0, tzinfo=UTC)
    conf = {**FULL, "batch_size": 5, "max_ranges": 3}
    r = run(conf, logical_date=logical, run_after=logical)
    assert r["state"] == "failed"
    assert r["tasks"]["reconcile_range[0]"] == "success"
    assert r["tasks"]["reconcile_range[2]"] == "failed"
    cursor = news_db.one("SELECT cursor_id::text FROM pin_nightly.sweep_range WHERE range_no = 2")
    assert ids[40] <= cursor < poison  # whole batches before the poison post are committed
    news_db.allow_updates()
    # clear and re-run the same run: done ranges return at once, the failed one resumes
    r2 = run(conf, logical_date=logical, run_after=logical)
    assert r2["state"] == "success" and r2["run_id"] == r["run_id"]
    rows = news_db.q(
        "SELECT range_no, rows_processed FROM pin_nightly.sweep_range ORDER BY range_no"
    )
    assert [n for _, n in rows] == [20, 20, 20]  # no post read twice across the two attempts
    assert news_db.drifted_posts() == 0
    assert news_db.one("SELECT count(*) FROM pin_nightly.news_drift") == 60


BAD_SCHEMA_CONF = [
    ({"batch_size": "10"}, "batch_size"),
    ({"batch_size": 0}, "batch_size"),
    ({"batch_size": 1.5}, "batch_size"),
    ({"scope": "Weekly"}, "scope"),
    ({"window_lookback_hours": 0}, "window_lookback_hours"),
    ({"max_run_duration_minutes": -1}, "max_run_duration_minutes"),
    ({"lock_ttl_minutes": "30"}, "lock_ttl_minutes"),
    ({"drift_alert_threshold": -5}, "drift_alert_threshold"),
    ({"post_ids": ["not-a-uuid"]}, "post_ids"),
    ({"post_ids": "0190a000-0000-7000-8000-000000000000"}, "post_ids"),
    ({"dry_run": "yes"}, "dry_run"),
    ({"max_ranges": 0}, "max_ranges"),
    ({"pace_max_wal_mb_per_second": -1}, "pace_max_wal_mb_per_second"),
    ({"pace_replica_conn_ids": "replica_db"}, "pace_replica_conn_ids"),
    ({"pace_replica_conn_ids": [""]}, "pace_replica_conn_ids"),
    ({"window_lookback_hours": 10**9}, "window_lookback_hours"),
    (
        {"max_run_duration_minutes": 10**9, "lock_ttl_minutes": 2 * 10**9},
        "max_run_duration_minutes",
    ),
]


@pytest.mark.parametrize("conf,param", BAD_SCHEMA_CONF, ids=[p for _, p in BAD_SCHEMA_CONF])
def test_invalid_conf_is_refused_by_the_params_schema(scheduler_dag, conf, param):
    from airflow.sdk.definitions.param import ParamValidationError

    params = scheduler_dag(DAG).params
    assert params.deep_merge({}).validate()["scope"] == "auto"  # the defaults pass
    with pytest.raises(ParamValidationError, match=param):
        params.deep_merge(conf).validate()


def test_invalid_conf_creates_no_run(news_db):
    """End to end, one case: Airflow refuses the run before it creates it."""
    from airflow.sdk.definitions.param import ParamValidationError

    conf, param = BAD_SCHEMA_CONF[0]
    before = run_count(DAG)
    with pytest.raises(ParamValidationError, match=param):
        run(conf)
    assert run_count(DAG) == before


@pytest.mark.parametrize(
    "conf,message",
    [
        ({"lock_ttl_minutes": 10, "max_run_duration_minutes": 20}, "lock_ttl_minutes"),
        ({"lock_ttl_minutes": 20, "max_run_duration_minutes": 20}, "must exceed"),
        ({"full_sweep_cron": "every sunday"}, "full_sweep_cron"),
        ({"scope": "FullSweep", "post_ids": ["0190a000-0000-7000-8000-000000000000"]}, "post_ids"),
    ],
)
def test_inconsistent_options_fail_before_any_write(news_db, conf, message, capfd, caplog):
    drifted = news_db.post(count=5, visible=3)
    r = run(conf)
    out = capfd.readouterr()
    assert r["state"] == "failed"
    assert r["tasks"]["validate_options"] == "failed"
    assert r["tasks"]["acquire_lease"] == "upstream_failed"
    assert message in out.out + out.err + caplog.text
    assert news_db.count(drifted) == 5
    # not even the job's own tables were created
    assert news_db.one("SELECT to_regclass('pin_nightly.job_lease') IS NULL")


def test_a_drift_spike_is_posted_to_the_alert_channel(news_db, monkeypatch, capfd, caplog):
    """The drift alert goes out through the pin_alerts HTTP connection (the http provider's
    notifier) when a run corrects more posts than its threshold, and is only logged, saying
    so, without that connection."""
    from tests.helpers import Webhook

    hook = Webhook()
    try:
        monkeypatch.setenv("AIRFLOW_CONN_PIN_ALERTS", hook.connection())
        news_db.post(count=5, visible=3)
        news_db.post(count=2, visible=1)
        r = run({**FULL, "drift_alert_threshold": 1})
        assert r["state"] == "success" and r["summary"]["drift_corrected"] == 2
        [msg] = hook.wait_for(lambda m: m.get("alert") == "drift_above_threshold", timeout=5)
        assert (msg["dag_id"], msg["run_id"]) == (DAG, r["summary"]["run_id"])
        assert (msg["drift_corrected"], msg["threshold"]) == (2, 1)
        assert msg["runbook"] == "docs/runbook.md#drift_above_threshold"

        monkeypatch.delenv("AIRFLOW_CONN_PIN_ALERTS")
        news_db.post(count=9, visible=1)
        r = run({**FULL, "drift_alert_threshold": 0})
        assert r["summary"]["drift_corrected"] == 1
        assert len(hook.received) == 1
        out = capfd.readouterr()
        assert "no notification channel is set" in out.out + out.err + caplog.text
    finally:
        hook.server.shutdown()
