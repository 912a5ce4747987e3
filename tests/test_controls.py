"""Controls over a running sweep (pin_nightly.controls), through the real DAGs on a real
PostgreSQL: pause and resume, a batch size and pacing limits changed mid-run, each read by the
range before its next batch; a paused range holds no lock and no transaction, and a sweep
paused until the budget ends leaves its run green with backlog_remaining; every control is in
the run's summary with who gave it; and each refusal, before anything is written."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from pin_nightly import catalog, controls, news
from pin_nightly.db import connection
from tests.helpers import after_each_batch, assert_ok, budget_spent_after_each_batch, night
from tools.rundag import run_dag

NEWS = "news_comment_reconcile"
FULL = {"scope": "FullSweep", "batch_size": 5, "max_ranges": 1}


def give(sweep_id: int, action: str, by: str = "anna", **settings) -> controls.Control:
    with connection(news.JOB.conn_id) as conn:
        return controls.give(conn, news.JOB, sweep_id, action, by, settings)


def open_sweep(db) -> int:
    return db.one("SELECT sweep_id FROM pin_nightly.sweep WHERE status = 'open'")


def held_by_the_job(db) -> tuple[int, int]:
    """Locks on news.posts, and sessions idle in a transaction open for more than a second (a
    paused range's control read or lease renewal is a transaction of milliseconds), of any
    session but this one."""
    locks = db.one(
        "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
        "WHERE c.relname = 'posts' AND l.pid <> pg_backend_pid()"
    )
    idle = db.one(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND state LIKE 'idle in transaction%%' AND pid <> pg_backend_pid() "
        "AND xact_start < clock_timestamp() - interval '1 second'"
    )
    return locks, idle


def test_a_paused_sweep_holds_nothing_and_resumes_where_it_was(news_db):
    db = news_db
    db.posts(20, drift_every=1)
    seen: dict = {}

    def after_first(_b) -> None:
        if seen:
            return
        sweep = open_sweep(db)
        seen["paused"] = give(sweep, "pause").paused
        seen["rows"] = db.one("SELECT rows_processed FROM pin_nightly.sweep_range")

        def later() -> None:
            time.sleep(controls.POLL_S * 2)
            seen["held"] = held_by_the_job(db)
            seen["rows_while_paused"] = db.one("SELECT rows_processed FROM pin_nightly.sweep_range")
            give(sweep, "resume", by="boris")

        seen["thread"] = threading.Thread(target=later)
        seen["thread"].start()

    with after_each_batch(after_first):
        r = run_dag(NEWS, FULL, logical_date=night(db.today() - timedelta(days=1)))
    seen["thread"].join()
    s = assert_ok(r)
    assert seen["paused"] is True
    assert seen["held"] == (0, 0), "a paused range held a lock or a transaction"
    assert seen["rows_while_paused"] == seen["rows"] == 5  # no batch while paused
    assert s["status"] == "success" and s["posts_reconciled"] == 20, s
    assert db.drifted_posts() == 0
    assert [(c["action"], c["given_by"]) for c in s["controls"]] == [
        ("pause", "anna"),
        ("resume", "boris"),
    ]
    pauses, paused_ms = db.q("SELECT pauses, paused_ms FROM pin_nightly.sweep_range")[0]
    assert pauses == {"operator": 1} and paused_ms >= controls.POLL_S * 1000


def test_batch_size_and_pacing_limits_change_mid_run(news_db):
    """After the first batch of 5 posts, the batch size becomes 2 and the WAL-rate limit a rate
    no batch stays under: the range pauses on the WAL rate until the limit is set to 0 (off)
    while it waits, then reads 2 posts a batch."""
    db = news_db
    db.posts(11, drift_every=1)
    sizes: list[int] = []
    later: list[threading.Thread] = []

    def each(b) -> None:
        sizes.append(b.counters.processed)
        if len(sizes) == 1:
            sweep = open_sweep(db)
            give(sweep, "settings", batch_size=2, pace_max_wal_mb_per_second=1e-6)

            def off() -> None:
                time.sleep(3)
                give(sweep, "settings", pace_max_wal_mb_per_second=0)

            later.append(threading.Thread(target=off))
            later[0].start()

    with after_each_batch(each):
        s = assert_ok(run_dag(NEWS, FULL, logical_date=night(db.today() - timedelta(days=1))))
    later[0].join()
    assert s["status"] == "success" and db.drifted_posts() == 0, s
    assert sizes == [5, 2, 2, 2], sizes
    [(pauses,)] = db.q("SELECT pauses FROM pin_nightly.sweep_range")
    assert pauses.get("wal_mb_per_second", 0) >= 1, pauses
    assert [c["action"] for c in s["controls"]] == ["settings", "settings"]


@pytest.mark.long
def test_a_sweep_paused_until_the_budget_ends_leaves_a_green_backlog(news_db):
    """A pause given to a sweep left open by an earlier run (no worker running it) is read by
    the range that resumes it: it waits, holding nothing, until its budget is spent; the run
    ends green with backlog_remaining. Resumed, the next run finishes the sweep."""
    db = news_db
    db.posts(10, drift_every=1)
    d = db.today() - timedelta(days=2)
    with budget_spent_after_each_batch(db):
        first = assert_ok(run_dag(NEWS, FULL, night(d)))
    assert first["status"] == "backlog_remaining", first
    sweep = open_sweep(db)
    give(sweep, "pause")
    stalled = assert_ok(
        run_dag(
            NEWS, {**FULL, "max_run_duration_minutes": 0.1}, logical_date=night(d + timedelta(1))
        )
    )
    assert stalled["status"] == "backlog_remaining" and stalled["posts_reconciled"] == 0, stalled
    assert db.drifted_posts() > 0
    give(sweep, "resume")
    done = assert_ok(run_dag(NEWS, FULL, logical_date=night(d + timedelta(days=2))))
    assert done["status"] == "success" and db.drifted_posts() == 0, done


@pytest.mark.parametrize(
    ("action", "settings", "status", "message"),
    [
        ("settings", {"batch_size": 0}, 422, "batch_size"),
        ("settings", {"batch_size": 10**9}, 422, "batch_size"),
        ("settings", {"pace_max_lock_waiters": -1}, 422, "pace_max_lock_waiters"),
        ("settings", {"scope": "FullSweep"}, 422, "is not a setting"),
        ("settings", {}, 422, "no setting given"),
        ("stop", {}, 422, "unknown control"),
        ("pause", {"batch_size": 3}, 422, "takes no settings"),
    ],
)
def test_a_control_out_of_bounds_is_refused_and_writes_nothing(
    news_db, action, settings, status, message
):
    db = news_db
    db.posts(3, drift_every=1)
    with budget_spent_after_each_batch(db):
        run_dag(NEWS, {**FULL, "batch_size": 1})
    sweep = open_sweep(db)
    with pytest.raises(controls.ControlError, match=message) as refused:
        give(sweep, action, **settings)
    assert refused.value.status == status
    assert db.q("SELECT * FROM pin_nightly.sweep_control") == []
    assert db.q("SELECT * FROM pin_nightly.control_event") == []


def test_a_control_of_a_sweep_not_open_or_of_another_job_is_refused(news_db):
    db = news_db
    db.posts(3, drift_every=1)
    assert_ok(run_dag(NEWS, FULL))
    done = db.one("SELECT sweep_id FROM pin_nightly.sweep")
    with pytest.raises(controls.ControlError, match="is done, not open") as refused:
        give(done, "pause")
    assert refused.value.status == 409
    with pytest.raises(controls.ControlError, match="no sweep") as refused:
        give(done + 1000, "pause")
    assert refused.value.status == 404
    with connection(news.JOB.conn_id) as conn, pytest.raises(controls.ControlError) as refused:
        controls.give(conn, catalog.JOB, done, "pause", "anna")  # news's sweep, asked as catalog
    assert refused.value.status == 404
    assert db.q("SELECT * FROM pin_nightly.control_event") == []


def test_an_adaptive_batch_size_follows_the_batch_time(news_db):
    """batch_target_ms: each post update takes 20 ms, the target is 100 ms: from 20 posts a
    batch (400 ms) the size halves, then settles near 5; it never leaves batch_size / 8 to
    batch_size * 8, and the run is exact."""
    db = news_db
    db.posts(60, drift_every=1)
    db.slow_updates(0.02)
    sizes: list[int] = []
    conf = {**FULL, "batch_size": 20, "batch_target_ms": 100}
    with after_each_batch(lambda b: sizes.append(b.counters.processed)):
        s = assert_ok(run_dag(NEWS, conf, logical_date=night(db.today() - timedelta(days=1))))
    assert s["status"] == "success" and db.drifted_posts() == 0, s
    assert sizes[0] == 20 and sizes[1] == 10, sizes  # 400 ms: halved (no more a step)
    assert all(2 <= n <= 10 for n in sizes[2:-1]), sizes  # near the target, within bounds
    assert sum(sizes) == 60


def slow_under_a_statement_timeout(db) -> None:
    """Each post update takes 0.3 s, and the job's sessions have a statement_timeout of 1 s:
    a batch of 8 posts (2.4 s) times out, one of 2 (0.6 s) does not."""
    db.slow_updates(0.3)
    db.q("SELECT set_config('x.db', current_database(), false)")
    db.q(
        "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET statement_timeout = 1000', "
        "current_setting('x.db')); END $$"
    )


def test_a_statement_timeout_halves_an_adaptive_batch_and_tries_it_again(news_db):
    """A batch that hits the session's statement_timeout is rolled back, halved and tried
    again; without a target batch time the same timeout fails the range."""
    db = news_db
    db.posts(8, drift_every=1)
    slow_under_a_statement_timeout(db)
    conf = {**FULL, "batch_size": 8}
    failed = run_dag(NEWS, conf, logical_date=night(db.today() - timedelta(days=2)))
    assert failed["tasks"]["reconcile_range[0]"] == "failed" and db.drifted_posts() == 8
    s = assert_ok(run_dag(NEWS, {**conf, "batch_target_ms": 500}))
    assert s["status"] == "success" and db.drifted_posts() == 0, s


def test_a_batch_size_given_from_the_console_is_where_an_adaptive_size_starts(news_db):
    """With a target batch time, a batch size given mid-run replaces the size the range
    adapts from: a batch of that size that times out is halved and tried again (before, the
    console's size was tried again and again, a statement timeout each, and the range
    failed)."""
    db = news_db
    db.posts(12, drift_every=1)
    slow_under_a_statement_timeout(db)
    given = []

    def give_eight(_batch):
        if not given:
            given.append(give(open_sweep(db), "settings", batch_size=8).settings)

    with after_each_batch(give_eight):
        r = run_dag(NEWS, {**FULL, "batch_size": 2, "batch_target_ms": 500})
    s = assert_ok(r)
    assert given == [{"batch_size": 8}]
    assert s["status"] == "success" and db.drifted_posts() == 0, s
