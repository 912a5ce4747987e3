"""Pacing on the database's health, on a real streaming replica.

The module starts a primary and its hot standby of its own (tools/replica.py: ``initdb``,
``pg_basebackup -R -X stream``, two postgres processes from the pgserver wheel, each on its
own socket): the jobs' database lives on that primary, so a replay paused here lags only for
these tests. Every assertion on timing reads the primary's clock (``news_drift.recorded_at``
against instants taken there), not the test's sleeps.
"""

from __future__ import annotations

import os
import threading
import time
import zlib

import psycopg
import pytest

from tests.conftest import SUFFIX
from tests.helpers import (
    NewsDB,
    SlowVacuum,
    after_each_batch,
    assert_ok,
    news_full_sweep_range,
    skip_module,
    wait_for,
)
from tools import devenv

NEWS = "news_comment_reconcile"
MB = 1024 * 1024
OFF = {
    "pace_max_replica_lag_seconds": 0,
    "pace_max_replica_lag_mb": 0,
    "pace_on_vacuum": False,
    "pace_max_wal_mb_per_second": 0,
    "pace_max_archive_backlog_segments": 0,
    "pace_max_lock_waiters": 0,
}


@pytest.fixture(scope="module")
def pair():
    """A primary with archive_mode on and its streaming hot standby, both removed at the end."""
    import shutil

    from tools.replica import start_pair

    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        skip_module("running as root without setpriv: cannot start postgres as pgserver")
    port = 20000 + zlib.crc32(SUFFIX.encode()) % 20000
    try:
        p = start_pair(SUFFIX, port)
    except (OSError, RuntimeError, TimeoutError) as exc:
        skip_module(f"cannot start a primary and a hot standby from the pgserver binaries: {exc}")
    yield p
    p.stop()
    assert not p.root.exists()


_template: list[str] = []


@pytest.fixture
def pace_db(pair, monkeypatch):
    """A fresh news database on the pair's primary; the job's connection news_db points at it."""
    from tools.datagen import create_news_schema

    if not _template:
        pair.primary.sql("DROP DATABASE IF EXISTS pace_template")
        pair.primary.sql("CREATE DATABASE pace_template")
        create_news_schema(pair.primary.dsn("pace_template"))
        devenv.run_sql_file(pair.primary.dsn("pace_template"), "schema/pin_nightly.sql")
        _template.append("pace_template")
    pair.primary.sql("DROP DATABASE IF EXISTS pace_news WITH (FORCE)")
    pair.primary.sql("CREATE DATABASE pace_news TEMPLATE pace_template")
    dsn = pair.primary.dsn("pace_news")
    monkeypatch.setenv("AIRFLOW_CONN_NEWS_DB", devenv.airflow_connection(dsn))
    from pin_nightly.db import connection

    with connection("news_db"):  # Airflow sets up its logging here, not under the test's capture
        pass
    conn = psycopg.connect(dsn, autocommit=True)
    yield NewsDB(dsn, conn)
    conn.close()
    pair.resume_replay()
    pair.archive_go()


@pytest.fixture
def pauses(monkeypatch):
    """The pin_nightly_pauses_total increments sent (and still sent on)."""
    from pin_nightly import health

    sent: list[dict] = []
    real = health.metrics.incr

    def incr(name, count=1, tags=None):
        if name == health.METRIC:
            sent.append(tags)
        real(name, count, tags)

    monkeypatch.setattr(health.metrics, "incr", incr)
    return sent


@pytest.fixture
def spans(monkeypatch):
    """The spans the job records, in memory."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pin_nightly import tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    return exporter


def logged(capfd, caplog) -> str:
    """What the job logged (to the output, or to the logging handlers once Airflow has set
    them up in this process)."""
    return capfd.readouterr().out + "\n" + caplog.text


def pausing(capfd, caplog) -> list[str]:
    """The pause lines the job logged."""
    out = logged(capfd, caplog)
    return [line[line.index("pausing: ") :] for line in out.splitlines() if "pausing: " in line]


def clock(db: NewsDB):
    return db.one("SELECT clock_timestamp()")


def write_wal(db: NewsDB, mb: float) -> None:
    """WAL of another client (the hot path) that the paused standby does not replay."""
    db.q("CREATE TABLE IF NOT EXISTS public.filler (x text)")
    db.q(
        "INSERT INTO public.filler SELECT repeat('x', 1000) FROM generate_series(1, %s)",
        int(mb * 900),
    )


def range_of(db: NewsDB, batch_size: int, limits: dict, run: str = "pace-run"):
    """A FullSweep range of the news job on ``db`` with ``limits``; returns a function that
    works it with ranges.run_range and returns its result."""
    from pin_nightly import jobs, news, ranges
    from pin_nightly import lease as leases
    from pin_nightly.db import connection

    def work(on_batch=None, max_run=5.0):
        with connection("news_db") as conn:
            jobs.preflight(conn, news.JOB)
            lease = leases.acquire(conn, news.JOB.lock_key, f"{NEWS}/{run}", max_run * 2, max_run)
            assert isinstance(lease, leases.Lease), lease
            rng, job = news_full_sweep_range(conn, lease, run, batch_size, limits)
            with after_each_batch(on_batch or (lambda _b: None)):
                return ranges.run_range(conn, rng, lease, batch_size, job)

    return work


def recorded(db: NewsDB, after=None, before=None) -> int:
    return db.one(
        "SELECT count(*) FROM pin_nightly.news_drift WHERE (%s::timestamptz IS NULL OR "
        "recorded_at > %s) AND (%s::timestamptz IS NULL OR recorded_at < %s)",
        after,
        after,
        before,
        before,
    )


def test_job_stops_writing_while_a_replica_lags_and_finishes_once_replay_resumes(
    pair, pace_db, capfd, caplog, pauses, spans
):
    """60 drifted posts in batches of 10, the standby's replay paused. After the second batch
    the hot path writes 2 MB of WAL: the standby is more than 0.5 MB behind (the limit), and
    the job writes nothing more until replay resumes 2.5 s later; then it finishes, every
    post exact."""
    pace_db.posts(60, drift_every=1)  # every post drifted by +3
    pair.wait_caught_up()
    pair.pause_replay()
    at: dict = {}
    done = [0]

    def resume_later():
        time.sleep(2.5)
        at["resume"] = clock(pace_db)
        pair.resume_replay()

    def on_batch(_b):
        done[0] += 1
        if done[0] == 2:
            write_wal(pace_db, 2)
            assert pair.replay_lag()[1] > 0.5 * MB
            at["over"] = clock(pace_db)
            threading.Thread(target=resume_later, daemon=True).start()

    limits = {**OFF, "pace_max_replica_lag_mb": 0.5}
    res = range_of(pace_db, 10, limits)(on_batch=on_batch)
    assert res.status == "done" and res.changed == 60
    assert recorded(pace_db, before=at["over"]) == 20  # the two batches before the lag
    assert recorded(pace_db, after=at["over"], before=at["resume"]) == 0  # nothing while over
    assert recorded(pace_db, after=at["resume"]) == 40
    assert pace_db.drifted_posts() == 0
    assert pace_db.q("SELECT DISTINCT comments_count FROM news.posts") == [(2,)]
    warned = pausing(capfd, caplog)
    assert warned and all("replica_lag_mb=" in m and "over 0.50" in m for m in warned), warned
    assert pauses == [{"dag_id": NEWS, "signal": "replica_lag_mb"}]
    paused = [s for s in spans.get_finished_spans() if "pin.batch.paused_ms" in s.attributes]
    assert len(paused) == 1 and paused[0].attributes["pin.batch.pause_signals"] == "replica_lag_mb"
    assert paused[0].attributes["pin.batch.paused_ms"] >= 2000


def test_named_replicas_are_read_on_their_own_connections_and_only_they_pace(
    pair, pace_db, monkeypatch
):
    """With replicas named (Airflow connections), the lag is read on each of them: the paused
    standby is over the limit under its connection's name. A run that names only another
    replica ignores the lagging standby (a delayed or cascading one may be left out); a named
    replica that cannot be reached pauses; a name with no connection fails the run's setup."""
    from pin_nightly import jobs, news
    from pin_nightly.db import JobConfigError, connection
    from pin_nightly.health import Health

    monkeypatch.setenv(
        "AIRFLOW_CONN_STANDBY_DB", devenv.airflow_connection(pair.standby.dsn("pace_news"))
    )
    nowhere = f"host={pair.root} port=1 user=postgres dbname=pace_news connect_timeout=2"
    monkeypatch.setenv("AIRFLOW_CONN_NOWHERE_DB", devenv.airflow_connection(nowhere))
    limits = {**OFF, "pace_max_replica_lag_mb": 0.5, "pace_max_replica_lag_seconds": 3600}
    pair.wait_caught_up()
    named = Health.from_opts({**limits, "pace_replica_conn_ids": ["standby_db"]})
    other = Health.from_opts({**limits, "pace_replica_conn_ids": ["nowhere_db"]})
    with connection("news_db") as conn:
        assert named.read(conn)[0] == []  # caught up
        pair.pause_replay()
        write_wal(pace_db, 2)
        over, _ = named.read(conn)
        assert [(r.signal, r.about) for r in over] == [("replica_lag_mb", "standby_db")]
        assert over[0].value > 1.5
        assert Health.from_opts(limits).read(conn)[0][0].about != "standby_db"  # the view's
        [unreachable] = other.read(conn)[0]  # the lagging standby is not named here
        assert unreachable.signal == "replica_unreachable"
        assert str(unreachable).startswith("replica_unreachable (nowhere_db: ")
        pair.resume_replay()
        wait_for(lambda: named.read(conn)[0] == [], what="the named standby to catch up")
    named.close()
    assert named._replica_conns == {}
    opts = {**news.DEFAULTS, "pace_replica_conn_ids": ["no_such_db"]}
    with pytest.raises(JobConfigError, match="'no_such_db' is not defined"):
        jobs.acquire_lease(news.JOB, opts, "named-replicas")
    assert pace_db.q("SELECT * FROM pin_nightly.job_lease") == []


def test_a_run_that_spends_its_budget_paused_ends_backlog_remaining_and_the_next_finishes(
    pair, pace_db, capfd, caplog
):
    """Through Airflow: the standby is over the lag limit for the whole run (budget 3 s): the
    run succeeds with status backlog_remaining and writes nothing; once replay resumes, the
    next run resumes the sweep and corrects every post."""
    from tools.rundag import run_dag

    pace_db.posts(30, drift_every=1)
    pair.wait_caught_up()
    pair.pause_replay()
    write_wal(pace_db, 1)
    conf = {
        "scope": "FullSweep",
        "batch_size": 10,
        **OFF,
        "pace_max_replica_lag_mb": 0.5,
        "max_run_duration_minutes": 0.05,
        "lock_ttl_minutes": 1,
    }
    r = run_dag(NEWS, conf)
    assert r["state"] == "success", r["tasks"]
    assert all(state == "success" for task, state in r["tasks"].items() if "range" in task)
    s = r["summary"]
    assert s["status"] == "backlog_remaining" and s["backlog_remaining"] is True, s
    assert s["posts_reconciled"] == 0 and pace_db.drifted_posts() == 30
    out = logged(capfd, caplog)
    assert "pausing: replica_lag_mb=" in out and "budget spent while paused" in out
    pair.resume_replay()
    pair.wait_caught_up()
    s2 = assert_ok(run_dag(NEWS, {**conf, "max_run_duration_minutes": 5, "lock_ttl_minutes": 10}))
    assert s2["status"] == "success" and s2["drift_corrected"] == 30, s2
    assert pace_db.drifted_posts() == 0


def _archived_posts(db: NewsDB, n: int = 3000) -> None:
    """Posts the job never touches: pages for a slowed VACUUM of news.posts to work through."""
    db.q(
        "INSERT INTO news.posts (id, status, comments_count, updated_at) "
        "SELECT gen_random_uuid(), 'Archived', 0, now() FROM generate_series(1, %s)",
        n,
    )


def test_job_pauses_while_a_vacuum_runs_on_the_table_it_writes(
    pair, pace_db, capfd, caplog, pauses
):
    """A real VACUUM of news.posts, slowed by its cost delay, runs when the job starts: the job
    writes nothing until the VACUUM is cancelled, then corrects every post."""
    pace_db.posts(30, drift_every=1)
    _archived_posts(pace_db)
    vacuum = SlowVacuum(pace_db.dsn, "news.posts").start()
    at: dict = {}
    canceller = vacuum.cancel_after(2.0, lambda: at.update(end=clock(pace_db)))
    try:
        res = range_of(pace_db, 10, {**OFF, "pace_on_vacuum": True})()
    finally:
        canceller.join(15)
    assert res.status == "done" and res.changed == 30
    assert recorded(pace_db, before=at["end"]) == 0
    assert recorded(pace_db, after=at["end"]) == 30 and pace_db.drifted_posts() == 0
    warned = pausing(capfd, caplog)
    assert warned and all(f"vacuum=running (news.posts pid {vacuum.pid}" in m for m in warned)
    assert pauses == [{"dag_id": NEWS, "signal": "vacuum"}]


def test_the_retry_of_a_skipped_row_paces_like_a_batch(pair, pace_db, capfd, caplog, spans):
    """A drifted post locked by another session is skipped by its batch; a VACUUM starts and the
    lock goes after the range's last batch: the end-of-range retry waits for the VACUUM, then
    corrects the post."""
    posts = pace_db.posts(15, drift_every=1)
    _archived_posts(pace_db)
    holder = psycopg.connect(pace_db.dsn)
    holder.execute("SELECT 1 FROM news.posts WHERE id = %s FOR UPDATE", (posts[7],))
    vacuum = SlowVacuum(pace_db.dsn, "news.posts")
    at: dict = {}
    batches = []

    def on_batch(b):
        batches.append(b)
        if b.full:
            return
        vacuum.start()  # after the range's last batch (15 posts, batches of 10)
        holder.rollback()
        vacuum.cancel_after(2.0, lambda: at.update(end=clock(pace_db)))

    try:
        res = range_of(pace_db, 10, {**OFF, "pace_on_vacuum": True})(on_batch=on_batch)
    finally:
        wait_for(lambda: "end" in at, timeout=15, what="the VACUUM cancelled")
        holder.close()
    assert len(batches) == 2 and res.retried == 1 and res.skipped_locked == 0
    assert res.status == "done" and pace_db.drifted_posts() == 0
    assert recorded(pace_db, after=at["end"]) == 1  # the retried post, once the VACUUM ended
    assert [m for m in pausing(capfd, caplog) if "vacuum=running" in m]
    [retry] = [s for s in spans.get_finished_spans() if s.name == "retry_locked_row"]
    assert retry.attributes["pin.batch.pause_signals"] == "vacuum"
    assert retry.attributes["pin.batch.paused_ms"] >= 1500


def test_lock_waiters_are_counted_at_the_end_of_a_batch(pace_db):
    """Two sessions wait for rows the job's connection holds locked: the sample taken in that
    transaction says 2, which is over a limit of 1 before the next batch, once."""
    from pin_nightly.db import connection, transaction
    from pin_nightly.health import Health

    a, b = pace_db.posts(2)
    h = Health({"lock_waiters": 1})
    waiters = []

    def wait_on(pid):
        with psycopg.connect(pace_db.dsn, autocommit=True) as c:
            c.execute("UPDATE news.posts SET comments_count = 2 WHERE id = %s", (pid,))

    with connection("news_db") as conn:
        with transaction(conn) as cur:
            cur.execute(
                "SELECT id FROM news.posts WHERE id = ANY(%s::uuid[]) FOR NO KEY UPDATE", ([a, b],)
            )
            for pid in (a, b):
                waiters.append(threading.Thread(target=wait_on, args=(pid,), daemon=True))
                waiters[-1].start()
            wait_for(
                lambda: pace_db.one("SELECT count(*) FROM pg_locks WHERE NOT granted") >= 2,
                what="two sessions waiting for the job's locks",
            )
            h.sample_lock_waiters(cur)
        over, _ = h.read(conn)
        assert [(r.signal, r.value, r.limit) for r in over] == [("lock_waiters", 2, 1)]
        assert h.read(conn)[0] == []  # the waiters went through once the batch committed
    for t in waiters:
        t.join(10)


def test_wal_rate_pauses_until_the_rate_falls_under_the_limit(pair, pace_db):
    """3 MB of WAL written at once on the primary (which nothing else writes to) is over a
    limit of 1 MB/s: the wait lasts until the rate over the window falls to the limit."""
    from pin_nightly.db import connection
    from pin_nightly.health import Health

    h = Health({"wal_mb_per_second": 1})
    with connection("news_db") as conn:
        assert h.read(conn)[0] == []  # one reading is no rate yet
        write_wal(pace_db, 3)
        over, _ = h.read(conn)
        assert [r.signal for r in over] == ["wal_mb_per_second"] and over[0].value > 1
        started = time.monotonic()
        pause = h.wait(conn)
        waited = time.monotonic() - started
    assert pause.signals == ["wal_mb_per_second"] and 1.0 <= waited <= 6, (pause, waited)


def test_archive_backlog_pauses_while_segments_wait_for_the_archiver(pair, pace_db):
    """archive_mode is on at the primary: with its archive_command failing, switched segments
    pile up; over 2 the signal is over its limit, and it clears once archiving works again."""
    from pin_nightly.db import connection
    from pin_nightly.health import Health

    h = Health({"archive_backlog_segments": 2})

    def switch():
        write_wal(pace_db, 0.01)
        pace_db.q("SELECT pg_switch_wal()")

    switch()
    wait_for(
        lambda: pace_db.one(
            "SELECT failed_count = 0 AND last_archived_wal IS NOT NULL FROM pg_stat_archiver"
        ),
        what="the archiver to archive",
    )
    with connection("news_db") as conn:
        assert h.read(conn)[0] == []
        pair.archive_stop()
        for _ in range(4):
            switch()
        over, _ = h.read(conn)
        # four switched segments (the archiver may have taken the first before the stop)
        assert [r.signal for r in over] == ["archive_backlog_segments"] and over[0].value >= 3
        pair.archive_go()
        switch()
        wait_for(lambda: h.read(conn)[0] == [], timeout=30, what="the archiver to catch up")


def test_limits_off_never_pause(pair, pace_db, capfd, caplog, pauses):
    """Every limit off: a standby far behind and a VACUUM running change nothing."""
    pace_db.posts(20, drift_every=1)
    pair.wait_caught_up()
    pair.pause_replay()
    write_wal(pace_db, 2)
    started = time.monotonic()
    res = range_of(pace_db, 10, OFF)()
    assert res.status == "done" and res.changed == 20 and pace_db.drifted_posts() == 0
    assert time.monotonic() - started < 5
    assert pausing(capfd, caplog) == []
    assert pauses == []


def test_both_jobs_have_the_pace_params_and_catalog_watches_its_tables(scheduler_dag):
    """Both DAGs take the same limits; 0 (or false) turns a signal off; the tables each job's
    batches write are what the vacuum signal watches."""
    from pin_nightly import catalog, health, news

    for dag_id in (NEWS, "catalog_popularity_recompute"):
        params = scheduler_dag(dag_id).params
        for lim in health.LIMITS:
            assert params[lim.param] == lim.default, (dag_id, lim.param)
        assert params[health.REPLICAS_PARAM] == []
    assert health.Health.from_opts(OFF).on is False
    assert health.Health.from_opts({}).limits == {
        "replica_lag_seconds": 30,
        "replica_lag_mb": 1024,
        "vacuum": 1,
        "wal_mb_per_second": 32,
        "archive_backlog_segments": 64,
        "lock_waiters": 1,
    }
    assert news.make_batch(news.DEFAULTS, 1, "r", False).writes == ("news.posts",)
    # not the job's own snapshot table, which its inserts make autovacuum visit all night
    assert catalog.make_batch("Project", catalog.DEFAULTS, 1, "r").writes == (
        "catalog.project_cards",
    )
