"""Reliability on a real PostgreSQL: concurrent load, faults, bad input and bad data.

- concurrent load: the news hot path and the catalog view consumer (pgbench,
  tools/pgbench.py) write while a run goes through Airflow; nothing may be torn or lost;
- faults: a worker SIGKILLed mid-batch, its connection terminated mid-batch, its lease taken
  over while it still runs, a missing connection / database / table / column / index;
- bad input (params) and bad data (orphans, counter resets, duplicates).

Figures (hot-path transactions during a run, skipped-locked posts, durations) are printed:
run with ``-s`` to see them.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import psycopg
import pytest

from tests.helpers import (
    ADVISORY_KEY,
    after_each_batch,
    assert_ok,
    bulk_posts,
    gate_waiter,
    install_gate,
    new_id,
    news_full_sweep_range,
    post_offsets,
    reference_popularity_score,
    remove_gate,
    run_night,
    wait_for,
    when,
)
from tools import pgbench
from tools.devenv import airflow_connection, run_sql_file
from tools.rundag import return_values, run_count, run_dag

NEWS = "news_comment_reconcile"
CATALOG = "catalog_popularity_recompute"
FULL = {"scope": "FullSweep"}
D = date(2026, 8, 31)  # a Monday, far enough back that every night a test runs is past
NEWS_KEY = "Pin:lock:job:scheduled:news-comment-reconcile"


def report(name: str, **figures) -> None:
    print(f"\n[figures] {name}: " + json.dumps(figures, default=str))


def range_results(dag_id: str, run_id: str, task_id: str) -> list[dict]:
    """The return values of the mapped range tasks of a run."""
    return return_values(dag_id, run_id, task_id)


def _logs(capfd, caplog) -> str:
    out = capfd.readouterr()
    return out.out + out.err + caplog.text


# --- 1. concurrent load: news -------------------------------------------------------------------


@pytest.mark.long
def test_news_full_sweep_under_hot_path_load(news_db):
    """A FullSweep (batches of 50 over 3000 posts) while the news hot path creates and hides
    comments as fast as it can on 6 connections (pgbench), three quarters of them on 8 hot posts.
    Afterwards every post's drift is exactly what it must be: 0 for every post that was correct (the
    hot path wrote many of them during the run) and for every drifted post the run reconciled; the
    injected offset, unchanged, for a post left skipped-locked. The job recorded exactly the
    injected drift of the posts it corrected: a count taken from a snapshot older than the row locks
    would show up as a correction of a correct post or an off-by-one correction. (Checked by
    mutation: without the row locks of the posts that look drifted, a lost or doubled hot-path
    update failed this test in 5 tries out of 10; the deterministic case of that race, a hot-path
    transaction holding a drifted post, is
    test_locked_post_is_skipped_and_the_hot_path_increment_is_not_lost.)"""
    rnd = random.Random(20261130)
    ids, drift = bulk_posts(news_db, 3000, rnd, drift_share=0.05)
    assert post_offsets(news_db) == {p: drift.get(p, 0) for p in ids}
    correct = [p for p in ids if p not in drift]
    hot = rnd.sample(correct, 4) + rnd.sample(sorted(drift), 4)
    with pgbench.PgBench(news_db.dsn, pgbench.NEWS, ids, hot, hot_share=0.75, clients=6) as hp:
        time.sleep(1)
        t0 = time.time()
        r = run_dag(NEWS, {**FULL, "batch_size": 50})
        t1 = time.time()
        time.sleep(0.2)
    stats = hp.result
    s = assert_ok(r)
    assert stats.failures == [], stats.failures[:5]
    assert stats.committed > 0

    skipped = {r[0] for r in news_db.q("SELECT post_id::text FROM pin_nightly.news_skipped_post")}
    expected = {p: (drift.get(p, 0) if p in skipped else 0) for p in ids}
    offsets = post_offsets(news_db)
    wrong = {p: (offsets[p], expected[p]) for p in ids if offsets[p] != expected[p]}
    assert wrong == {}, f"{len(wrong)} posts wrong (got, expected): {list(wrong.items())[:10]}"
    # what the job corrected: exactly the injected drift, each post once, nothing else
    corrections = news_db.q(
        "SELECT post_id::text, count_from - count_to FROM pin_nightly.news_drift"
    )
    assert len(corrections) == len({p for p, _ in corrections})
    assert dict(corrections) == {p: off for p, off in drift.items() if p not in skipped}
    # the job wrote no correct post (updated_at untouched), the hot path never writes updated_at
    assert news_db.one(
        "SELECT count(*) FROM news.posts WHERE updated_at <> '2026-01-01 00:00+00'"
    ) == len(drift) - len(skipped & drift.keys())
    assert s["posts_skipped_locked"] == len(skipped)
    assert s["posts_reconciled"] == len(ids) - len(skipped)
    assert s["drift_corrected"] == len(drift) - len(skipped & drift.keys())
    # the hot path really wrote during the batches, on hot and on drifted posts
    start, end = news_db.q(
        "SELECT extract(epoch FROM l.started_at)::float8, "
        "       extract(epoch FROM (SELECT max(updated_at) FROM pin_nightly.sweep_range))::float8 "
        "  FROM pin_nightly.run_log l"
    )[0]
    during_sweep = len(stats.between(start, end))
    assert during_sweep > 0
    touched = {
        p
        for [p] in news_db.q(
            "SELECT DISTINCT post_id::text FROM news.comments WHERE created_at >= to_timestamp(%s)",
            hp.started,
        )
    }
    assert set(hot) <= touched and touched & drift.keys()
    ranges = range_results(NEWS, r["run_id"], "reconcile_range")
    assert sum(x["processed"] for x in ranges) == s["posts_reconciled"]
    retried = sum(x["retried"] for x in ranges)  # skipped in their batch, taken at the range end
    report(
        "news hot path during a FullSweep",
        posts=len(ids),
        drifted=len(drift),
        batch_size=50,
        batches=s["batches_processed"],
        run_ms=s["duration_ms"],
        sweep_s=round(end - start, 2),
        dag_test_s=round(t1 - t0, 2),
        hot_path_tx_during_dag_test=len(stats.between(t0, t1)),
        hot_path_tx_during_batches=during_sweep,
        hot_path_tps=round(stats.committed / stats.elapsed_s),
        hot_path_max_tx_ms=max(ms for _, ms in stats.tx),
        hot_path_counter_update_avg_ms=[
            ms for sql, ms in stats.statements.items() if sql.startswith("UPDATE news.posts")
        ],
        posts_touched=len(touched),
        skipped_then_retried=retried,
        skipped_locked=s["posts_skipped_locked"],
        drift_corrected=s["drift_corrected"],
    )


# --- 2. concurrent load: catalog ----------------------------------------------------------------

CARD_TABLES = {
    "PropertyObject": "catalog.property_object_cards",
    "Project": "catalog.project_cards",
}


def _views(db) -> dict[str, int]:
    return dict(
        db.q(
            "SELECT id::text, popularity_views FROM catalog.property_object_cards "
            "UNION ALL SELECT id::text, popularity_views FROM catalog.project_cards"
        )
    )


@pytest.mark.long
def test_catalog_run_under_concurrent_view_consumers(catalog_db):
    """4 consumer connections (pgbench) increment popularity_views (autocommit, as the consumer
    does) on 1000 cards, half the increments on 6 hot cards, during a run in batches of 20. Each
    card's snapshot of the date is a value its counter really had during the run, its score is the
    formula over that snapshot, and no increment is lost. Re-running the date with the consumers
    stopped snapshots the settled counters and gives exactly the independent computation."""
    from tools.datagen import copy_rows

    rnd = random.Random(11)
    run_sql_file(catalog_db.dsn, "schema/catalog_popularity.sql")
    cards: dict[str, str] = {}
    history: dict[str, dict[date, int]] = {}
    rows = {k: [] for k in CARD_TABLES}
    snaps = []
    for i in range(1000):
        kind = "Project" if i % 10 == 0 else "PropertyObject"
        cid = new_id()
        v2 = rnd.randint(0, 300)
        v1 = v2 + rnd.randint(0, 50)
        now = v1 + rnd.randint(0, 50)
        cards[cid] = kind
        history[cid] = {D - timedelta(days=2): v2, D - timedelta(days=1): v1}
        rows[kind].append((cid, "Published", now, 0, datetime(2026, 1, 1, tzinfo=UTC)))
        snaps += [(kind, cid, d, v) for d, v in history[cid].items()]
    catalog_db.partition(D - timedelta(days=2), D - timedelta(days=1))
    with psycopg.connect(catalog_db.dsn) as conn:
        for kind, table in CARD_TABLES.items():
            copy_rows(
                conn,
                table,
                ("id", "status", "popularity_views", "popularity_score", "updated_at"),
                rows[kind],
            )
        copy_rows(
            conn,
            "catalog.popularity_daily_views",
            ("card_kind", "card_id", "run_date", "cumulative_views"),
            snaps,
        )
    ids = list(cards)
    hot = rnd.sample(ids, 6)
    before = _views(catalog_db)
    with pgbench.PgBench(catalog_db.dsn, pgbench.VIEWS, ids, hot, clients=4) as consumers:
        time.sleep(1)
        t0 = time.time()
        r = run_night(CATALOG, {"batch_size": 20}, D)
        t1 = time.time()
    views = consumers.result
    s = assert_ok(r)
    assert views.failures == [] and views.committed > 0
    after = _views(catalog_db)
    assert sum(after.values()) - sum(before.values()) == views.committed  # no increment lost
    today = dict(
        catalog_db.q(
            "SELECT card_id::text, cumulative_views FROM "
            "catalog.popularity_daily_views WHERE run_date = %s",
            D,
        )
    )
    skipped = s["property_object_cards_skipped_locked"] + s["project_cards_skipped_locked"]
    assert len(today) == len(ids) - skipped
    scores = dict(
        catalog_db.q(
            "SELECT id::text, popularity_score FROM "
            "catalog.property_object_cards UNION ALL SELECT id::text, "
            "popularity_score FROM catalog.project_cards"
        )
    )
    for cid, snap in today.items():
        assert before[cid] <= snap <= after[cid], cid
        assert scores[cid] == reference_popularity_score({**history[cid], D: snap}, D, 30, 7), cid
    moved = sum(1 for c in today if today[c] != after[c])

    # the same date again, the consumers stopped: the settled counters, the formula exactly
    s2 = assert_ok(run_night(CATALOG, {"batch_size": 20}, D))
    today = dict(
        catalog_db.q(
            "SELECT card_id::text, cumulative_views FROM "
            "catalog.popularity_daily_views WHERE run_date = %s",
            D,
        )
    )
    assert today == after
    for table in CARD_TABLES.values():
        for cid, score in catalog_db.q(f"SELECT id::text, popularity_score FROM {table}"):
            assert score == reference_popularity_score({**history[cid], D: after[cid]}, D, 30, 7), (
                cid
            )
    assert s2["item_errors"] == 0
    report(
        "catalog consumers during a run",
        cards=len(ids),
        batch_size=20,
        run_ms=s["duration_ms"],
        dag_test_s=round(t1 - t0, 2),
        consumer_increments_during_run=len(views.between(t0, t1)),
        increments_total=views.committed,
        cards_whose_counter_moved_after_their_snapshot=moved,
        skipped_locked=skipped,
        rerun_cards_updated=s2["property_object_cards_updated"] + s2["project_cards_updated"],
    )


# --- 3a. a worker killed with SIGKILL mid-batch -------------------------------------------------

WORKER = textwrap.dedent("""
    import json, sys
    from pin_nightly import jobs, news, ranges, sweeps
    from pin_nightly import lease as leases
    from pin_nightly.db import connection, sql

    cfg = json.loads(sys.argv[1])
    opts = {{**news.DEFAULTS, "batch_size": cfg["batch_size"], "effective_scope": "FullSweep"}}
    with connection("news_db") as conn:
        jobs.preflight(conn, news.JOB)
        lease = leases.acquire(conn, news.JOB.lock_key, cfg["holder"], cfg["ttl"], cfg["max_run"])
        assert isinstance(lease, leases.Lease), lease
        spec = sweeps.SweepSpec(job=news.JOB.code, family="FullSweep")
        sweep = sweeps.open_sweep(
            conn, spec, lease, cfg["run_id"], lambda cur, s: sweeps.boundaries(
                cur, sql("news/full_source").strip(), {{"sweep_id": s["sweep_id"]}},
                cfg["batch_size"], 1))
        [rng] = sweeps.range_descriptors(sweep, "FullSweep")
        job = news.make_batch(opts, sweep["sweep_id"], cfg["run_id"], candidate_mode=False)
        print("working", sweep["sweep_id"], flush=True)
        res = ranges.run_range(conn, rng, lease, cfg["batch_size"], job)
        print("finished", json.dumps(res.__dict__), flush=True)
""").format()


def gated_worker(news_db, tmp_path, name: str, env: dict[str, str] | None = None):
    """100 drifted posts and a range worker (WORKER, batches of 10, lease TTL 0.05 min, run
    budget 0.04 min) in its own process, whose third batch is held in flight by a trigger
    waiting for an advisory lock the test holds. Returns (ids, worker, gate connection,
    the batch's backend pid) once the batch waits there."""
    ids = news_db.posts(100, drift_every=1)  # every post drifted by +3
    install_gate(news_db, "news.posts", ids[25])
    gate = psycopg.connect(news_db.dsn, autocommit=True)
    gate.execute("SELECT pg_advisory_lock(%s)", (ADVISORY_KEY,))
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cfg = {"batch_size": 10, "holder": f"{name}/run-1", "run_id": f"{name}-run-1"}
    cfg |= {"ttl": 0.05, "max_run": 0.04}
    proc = subprocess.Popen(
        [sys.executable, str(script), json.dumps(cfg)],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pid = wait_for(
        lambda: gate_waiter(news_db) or proc.poll() is not None,
        timeout=90,
        what="the worker's third batch at the gate",
    )
    if proc.poll() is not None:
        out, err = proc.communicate()
        gate.close()
        pytest.fail(f"worker exited early ({proc.returncode}): {out}\n{err[-3000:]}")
    return ids, proc, gate, pid


def test_sigkill_mid_batch_rolls_the_batch_back_and_the_next_run_resumes(news_db, tmp_path):
    """A range worker in its own process (lease TTL 0.05 min, run budget 0.04 min) commits two
    batches of 10, then its third batch is held in flight (a trigger waits for an advisory lock
    the test holds) and the process is SIGKILLed. The orphaned backend is let go: the batch is
    rolled back (cursor and corrected posts agree: 20), the lease expires by its TTL, and a DAG
    run adopts the sweep and resumes from the cursor: 80 more posts, none corrected twice."""
    ids, proc, gate, pid = gated_worker(news_db, tmp_path, "killed-worker")
    try:
        in_flight = news_db.q("SELECT cursor_id::text, batches FROM pin_nightly.sweep_range")
        assert in_flight == [(ids[19], 2)]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    # the orphaned backend still waits at the gate, its batch uncommitted; let it go
    assert gate_waiter(news_db) == pid
    gate.execute("SELECT pg_advisory_unlock(%s)", (ADVISORY_KEY,))
    gate.close()
    ended = wait_for(
        lambda: news_db.one("SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = %s", pid),
        timeout=15,
        what="the orphaned backend to notice its client is gone",
    )
    assert ended
    remove_gate(news_db, "news.posts")
    # the batch in flight was rolled back as a whole: cursor and corrections agree
    assert news_db.q("SELECT cursor_id::text, batches, status FROM pin_nightly.sweep_range") == [
        (ids[19], 2, "pending")
    ]
    fixed = sorted(p for p in ids if news_db.count(p) == 2)
    assert fixed == ids[:20]
    assert (
        sorted(r[0] for r in news_db.q("SELECT post_id::text FROM pin_nightly.news_drift"))
        == ids[:20]
    )
    # the lease was not released; it expires by its TTL
    holder, expired = news_db.q("SELECT holder, expires_at <= now() FROM pin_nightly.job_lease")[0]
    assert holder == "killed-worker/run-1"
    wait_for(
        lambda: news_db.one("SELECT bool_and(expires_at <= now()) FROM pin_nightly.job_lease"),
        timeout=10,
        what="the lease to expire",
    )
    sweep_id = news_db.one("SELECT sweep_id FROM pin_nightly.sweep")
    s = assert_ok(run_dag(NEWS, {**FULL, "batch_size": 10, "max_ranges": 1}))
    assert s["sweep_id"] == sweep_id  # adopted, not planned again
    assert s["posts_reconciled"] == 80 and s["drift_corrected"] == 80
    assert news_db.drifted_posts() == 0
    assert news_db.one("SELECT count(*) FROM pin_nightly.news_drift") == 100
    assert news_db.one("SELECT count(DISTINCT post_id) FROM pin_nightly.news_drift") == 100
    assert news_db.q("SELECT count(*) FROM pin_nightly.job_lease") == [(0,)]
    report(
        "SIGKILL mid-batch",
        committed_before_kill=20,
        rolled_back_batch=10,
        resumed=s["posts_reconciled"],
        lease_still_valid_after_kill=not expired,
        orphan_backend_ended_on_its_own=True,
    )


def test_a_worker_stalled_inside_a_batch_has_its_session_ended_and_its_locks_freed(
    news_db, tmp_path
):
    """A range worker in its own process (session bound idle_in_transaction_session_timeout 1 s,
    from the connection's options) is stopped (SIGSTOP) while its third batch is in flight:
    once that batch's statement completes the session is idle inside its transaction, and the
    server ends it. The batch is rolled back and its row locks are free while the worker is
    still stopped; the worker, resumed, fails on its dead connection; after the lease's TTL a
    DAG run adopts the sweep and resumes from the cursor, none corrected twice."""
    conn = json.loads(os.environ["AIRFLOW_CONN_NEWS_DB"])
    conn["extra"] = {"options": "-c idle_in_transaction_session_timeout=1s"}
    ids, proc, gate, pid = gated_worker(
        news_db, tmp_path, "stalled-worker", {"AIRFLOW_CONN_NEWS_DB": json.dumps(conn)}
    )
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        gate.execute("SELECT pg_advisory_unlock(%s)", (ADVISORY_KEY,))  # the statement completes
        wait_for(
            lambda: news_db.one("SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = %s", pid),
            timeout=15,
            what="the server to end the idle transaction",
        )
        assert proc.poll() is None  # still stopped: the server, not the worker, ended it
        with psycopg.connect(news_db.dsn) as other:  # the batch's rows are free
            locked = other.execute(
                "SELECT count(*) FROM (SELECT 1 FROM news.posts WHERE id = ANY(%s::uuid[]) "
                "FOR UPDATE NOWAIT) x",
                (ids[20:30],),
            ).fetchone()
        assert locked == (10,)
        assert news_db.q("SELECT cursor_id::text, batches FROM pin_nightly.sweep_range") == [
            (ids[19], 2)
        ]
        assert sorted(p for p in ids if news_db.count(p) == 2) == ids[:20]
        os.kill(proc.pid, signal.SIGCONT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait(10)
        gate.close()
    assert proc.returncode != 0
    assert "idle-in-transaction timeout" in err or "closed the connection" in err, err[-2000:]
    remove_gate(news_db, "news.posts")
    wait_for(
        lambda: news_db.one("SELECT bool_and(expires_at <= now()) FROM pin_nightly.job_lease"),
        timeout=10,
        what="the stalled worker's lease to expire",
    )
    s = assert_ok(run_dag(NEWS, {**FULL, "batch_size": 10, "max_ranges": 1}))
    assert s["posts_reconciled"] == 80 and s["drift_corrected"] == 80
    assert news_db.drifted_posts() == 0
    assert news_db.one("SELECT count(DISTINCT post_id) FROM pin_nightly.news_drift") == 100
    assert news_db.one("SELECT count(*) FROM pin_nightly.news_drift") == 100


# --- 3b. the database connection dropped mid-run ------------------------------------------------


def test_connection_terminated_mid_batch_fails_the_task_and_a_retry_resumes(news_db, capfd, caplog):
    """pg_terminate_backend on the worker's backend while its third batch waits: the batch is
    rolled back, the mapped task fails with the server's message, the teardown releases the
    lease; running the same DAG run again (a retry) resumes from the cursor."""
    ids = news_db.posts(60, drift_every=1)
    install_gate(news_db, "news.posts", ids[25])
    gate = psycopg.connect(news_db.dsn, autocommit=True)
    gate.execute("SELECT pg_advisory_lock(%s)", (ADVISORY_KEY,))
    killed = []

    def terminate():
        pid = gate_waiter(news_db)
        killed.append((pid, news_db.one("SELECT cursor_id::text FROM pin_nightly.sweep_range")))
        news_db.q("SELECT pg_terminate_backend(%s)", pid)

    watcher = when(lambda: gate_waiter(news_db) is not None, terminate, timeout=120)
    logical = datetime(2026, 11, 25, 9, 0, tzinfo=UTC)
    conf = {**FULL, "batch_size": 10, "max_ranges": 1}
    capfd.readouterr()
    try:
        t0 = time.monotonic()
        r = run_dag(NEWS, conf, logical_date=logical, run_after=logical)
        failed_after = time.monotonic() - t0
    finally:
        watcher.join(5)
        gate.execute("SELECT pg_advisory_unlock(%s)", (ADVISORY_KEY,))
        gate.close()
    text = _logs(capfd, caplog)
    assert killed and killed[0][1] == ids[19]
    assert r["state"] == "failed"
    assert r["tasks"]["reconcile_range[0]"] == "failed"
    assert r["tasks"]["summarize"] == "failed"  # it ran, logged the run, and failed it
    assert r["tasks"]["release_lease"] == "success"
    assert (
        "terminating connection due to administrator command" in text
        or "server closed the connection unexpectedly" in text
    ), text[-3000:]
    assert news_db.q("SELECT cursor_id::text, batches FROM pin_nightly.sweep_range") == [
        (ids[19], 2)
    ]
    assert sorted(p for p in ids if news_db.count(p) == 2) == ids[:20]
    assert news_db.one("SELECT count(*) FROM pin_nightly.news_drift") == 20
    assert news_db.q("SELECT count(*) FROM pin_nightly.job_lease") == [(0,)]
    remove_gate(news_db, "news.posts")
    r2 = run_dag(NEWS, conf, logical_date=logical, run_after=logical)
    s = assert_ok(r2)
    assert r2["run_id"] == r["run_id"]
    assert s["posts_reconciled"] == 60 and s["drift_corrected"] == 60  # 20 + 40, none twice
    assert news_db.drifted_posts() == 0
    assert news_db.one(
        "SELECT count(DISTINCT post_id) = 60 AND count(*) = 60 FROM pin_nightly.news_drift"
    )
    report(
        "connection terminated mid-batch",
        committed_before=20,
        resumed_by_retry=40,
        failed_run_s=round(failed_after, 1),
    )


# --- 3b'. the server ends a statement that runs or waits too long -------------------------------


@pytest.mark.parametrize("bound", ["statement_timeout", "lock_timeout"])
def test_a_batch_past_its_session_bound_is_ended_by_the_server_and_its_retry_resumes(
    news_db, monkeypatch, capfd, caplog, bound
):
    """The job's sessions are bounded by the server (defaults in pin_nightly.db.SESSION_BOUNDS;
    here 1 s, from the connection's ``options`` extra). The third batch's update of one post
    runs too long (a trigger sleeps: statement_timeout) or waits for a lock another session
    keeps (an advisory lock: lock_timeout): the server cancels it, the batch rolls back, the
    range fails saying which timeout ended it, and clearing it resumes from the cursor."""
    from tools.rundag import clear_and_resume

    ids = news_db.posts(60, drift_every=1)
    conn = json.loads(os.environ["AIRFLOW_CONN_NEWS_DB"])
    monkeypatch.setenv(
        "AIRFLOW_CONN_NEWS_DB", json.dumps({**conn, "extra": {"options": f"-c {bound}=1s"}})
    )
    holder = psycopg.connect(news_db.dsn, autocommit=True)
    if bound == "lock_timeout":
        install_gate(news_db, "news.posts", ids[25])
        holder.execute("SELECT pg_advisory_lock(%s)", (ADVISORY_KEY,))
    else:
        news_db.q(
            "CREATE FUNCTION public.pin_test_slow() RETURNS trigger LANGUAGE plpgsql AS $$ "
            f"BEGIN IF NEW.id = '{ids[25]}'::uuid THEN PERFORM pg_sleep(30); END IF; "
            "RETURN NEW; END $$"
        )
        news_db.q(
            "CREATE TRIGGER pin_test_gate BEFORE UPDATE ON news.posts FOR EACH ROW "
            "EXECUTE FUNCTION public.pin_test_slow()"
        )
    conf = {**FULL, "batch_size": 10, "max_ranges": 1}
    capfd.readouterr()
    t0 = time.monotonic()
    try:
        r = run_dag(NEWS, conf)
    finally:
        holder.close()
    took = time.monotonic() - t0
    text = _logs(capfd, caplog)
    assert r["tasks"]["reconcile_range[0]"] == "failed" and r["state"] == "failed"
    assert r["tasks"]["release_lease"] == "success"
    assert f"canceling statement due to {bound.replace('_', ' ')}" in text, text[-3000:]
    assert took < 25  # ended by the server after 1 s, not by the trigger's 30 s sleep
    # the third batch was rolled back as a whole: cursor and corrections agree
    assert news_db.q("SELECT cursor_id::text, batches FROM pin_nightly.sweep_range") == [
        (ids[19], 2)
    ]
    assert sorted(p for p in ids if news_db.count(p) == 2) == ids[:20]
    remove_gate(news_db, "news.posts")
    s = assert_ok(clear_and_resume(NEWS, r["run_id"]))
    assert s["posts_reconciled"] == 60 and s["drift_corrected"] == 60  # 20 + 40, none twice
    assert news_db.drifted_posts() == 0
    assert news_db.one("SELECT count(DISTINCT post_id) FROM pin_nightly.news_drift") == 60
    assert news_db.one("SELECT count(*) FROM pin_nightly.news_drift") == 60


def test_job_sessions_are_bounded_unless_the_connection_bounds_them(news_db):
    """Defaults where the session has none; a value the connection sets is kept."""
    from pin_nightly.db import SESSION_BOUNDS, bound_session

    with psycopg.connect(news_db.dsn) as conn:
        assert bound_session(conn) == SESSION_BOUNDS
        assert conn.execute("SHOW idle_in_transaction_session_timeout").fetchone() == ("1min",)
    with psycopg.connect(news_db.dsn, options="-c lock_timeout=2s") as conn:
        assert bound_session(conn) == {**SESSION_BOUNDS, "lock_timeout": "2s"}


def test_job_sessions_compress_wal_where_the_role_may(news_db, monkeypatch):
    """wal_compression (zstd, else lz4, else pglz) in every job session whose role may set it
    and whose server leaves it off: a superuser, or a role granted SET ON PARAMETER (the option
    in roles.sql); a role without the grant, or a server that sets it, keeps the server's
    value."""
    from psycopg.conninfo import make_conninfo

    from pin_nightly.db import bound_session

    methods = news_db.one("SELECT enumvals FROM pg_settings WHERE name = 'wal_compression'")
    best = next(m for m in ("zstd", "lz4", "pglz") if m in methods)
    login = f"pin_walc_{os.getpid()}"
    news_db.q(f'CREATE ROLE "{login}" LOGIN')
    try:
        as_login = make_conninfo(news_db.dsn, user=login)
        cases = [(news_db.dsn, "", best), (as_login, "", "off")]  # a superuser; no grant
        if best != "pglz":  # a server built with zstd or lz4: a value set there is kept
            cases.append((news_db.dsn, "-c wal_compression=pglz", "pglz"))
        for dsn, options, expected in cases:
            with psycopg.connect(dsn, options=options) as conn:
                bound_session(conn)
                assert conn.execute("SHOW wal_compression").fetchone() == (expected,)
        news_db.q(f'GRANT SET ON PARAMETER wal_compression TO "{login}"')
        with psycopg.connect(as_login) as conn:
            bound_session(conn)
            assert conn.execute("SHOW wal_compression").fetchone() == (best,)
        # a deployment's choice: another order, or none
        for setting, expected in (("pglz", "pglz"), ("off", "off")):
            monkeypatch.setenv("PIN_WAL_COMPRESSION", setting)
            with psycopg.connect(as_login) as conn:
                bound_session(conn)
                assert conn.execute("SHOW wal_compression").fetchone() == (expected,)
    finally:
        news_db.q(f'REVOKE ALL ON PARAMETER wal_compression FROM "{login}"')
        news_db.q(f'DROP ROLE "{login}"')


# --- 3c. the lease taken over while a slow worker still runs (fencing) --------------------------


def test_a_worker_whose_lease_was_taken_over_stops_before_its_next_write(news_db):
    """After the slow worker's first batch its lease expires and another holder acquires it:
    the worker's next batch raises LeaseLost before writing anything."""
    from pin_nightly import jobs, news, ranges
    from pin_nightly import lease as leases
    from pin_nightly.db import connection
    from pin_nightly.lease import LeaseLost

    ids = news_db.posts(30, drift_every=1)
    taken = []

    def take_over(_batch):
        if taken:
            return
        news_db.q("UPDATE pin_nightly.job_lease SET expires_at = now() - interval '1 second'")
        with connection("news_db") as other:
            taken.append(leases.acquire(other, NEWS_KEY, "other-deployment/run-2", 10, 5))

    with connection("news_db") as conn:
        jobs.preflight(conn, news.JOB)
        lease = leases.acquire(conn, NEWS_KEY, "slow-worker/run-1", 10, 5)
        rng, batch = news_full_sweep_range(conn, lease, "slow-run-1", 10)
        with (
            after_each_batch(take_over),
            pytest.raises(LeaseLost, match="expired or was taken over"),
        ):
            ranges.run_range(conn, rng, lease, 10, batch)
    assert isinstance(taken[0], leases.Lease) and taken[0].token > lease.token
    assert news_db.q("SELECT holder FROM pin_nightly.job_lease") == [("other-deployment/run-2",)]
    assert news_db.q("SELECT cursor_id::text, batches FROM pin_nightly.sweep_range") == [
        (ids[9], 1)
    ]
    assert sorted(p for p in ids if news_db.count(p) == 2) == ids[:10]  # nothing after batch 1
    assert news_db.one("SELECT count(*) FROM pin_nightly.news_drift") == 10


def _closed_gate(db, post_id: str) -> psycopg.Connection:
    """A batch updating ``post_id`` waits in flight until the returned session unlocks
    :data:`ADVISORY_KEY`."""
    install_gate(db, "news.posts", post_id)
    gate = psycopg.connect(db.dsn, autocommit=True)
    gate.execute("SELECT pg_advisory_lock(%s)", (ADVISORY_KEY,))
    return gate


def test_a_lease_expiring_during_a_batch_cannot_be_taken_until_that_batch_ends(news_db):
    """The lease (TTL 0.03 min) expires while the worker's second batch is held in flight.
    Another holder's acquisition waits for that batch (the fence holds the lease row FOR
    SHARE), so the two never write at the same time; then the worker stops with LeaseLost
    before its third batch."""
    from pin_nightly import jobs, news, ranges
    from pin_nightly import lease as leases
    from pin_nightly.db import connection
    from pin_nightly.lease import LeaseLost

    ids = news_db.posts(30, drift_every=1)
    gate = _closed_gate(news_db, ids[15])
    outcome: dict = {}

    def slow_worker():
        try:
            with connection("news_db") as conn:
                jobs.preflight(conn, news.JOB)
                lease = leases.acquire(conn, NEWS_KEY, "slow-worker/run-1", 0.03, 0.02)
                outcome["lease"] = lease
                rng, batch = news_full_sweep_range(conn, lease, "slow-run-1", 10)
                outcome["result"] = ranges.run_range(conn, rng, lease, 10, batch)
        except BaseException as exc:  # noqa: BLE001
            outcome["error"] = exc

    def other_holder():
        with connection("news_db") as conn:
            outcome["other"] = leases.acquire(conn, NEWS_KEY, "other-deployment/run-2", 10, 5)
            outcome["other_at"] = time.monotonic()

    worker = threading.Thread(target=slow_worker, daemon=True)
    worker.start()
    try:
        wait_for(
            lambda: gate_waiter(news_db) or "error" in outcome,
            timeout=30,
            what="the second batch at the gate",
        )
        assert "error" not in outcome, outcome
        wait_for(
            lambda: news_db.one("SELECT expires_at <= now() FROM pin_nightly.job_lease"),
            timeout=10,
            what="the lease to expire by its TTL",
        )
        other = threading.Thread(target=other_holder, daemon=True)
        other.start()
        time.sleep(1.0)
        assert other.is_alive() and "other" not in outcome  # waiting for the batch in flight
        released_at = time.monotonic()
    finally:
        gate.execute("SELECT pg_advisory_unlock(%s)", (ADVISORY_KEY,))
        gate.close()
    other.join(30)
    worker.join(30)
    remove_gate(news_db, "news.posts")
    assert isinstance(outcome.get("other"), leases.Lease)
    assert outcome["other_at"] >= released_at
    assert isinstance(outcome.get("error"), LeaseLost), outcome
    assert outcome["other"].token > outcome["lease"].token
    # the batch in flight committed under the old lease (nobody could take it meanwhile);
    # nothing was written after it
    assert news_db.q("SELECT cursor_id::text, batches FROM pin_nightly.sweep_range") == [
        (ids[19], 2)
    ]
    assert sorted(p for p in ids if news_db.count(p) == 2) == ids[:20]
    assert news_db.one(
        "SELECT max(recorded_at) <= (SELECT acquired_at FROM "
        "pin_nightly.job_lease) FROM pin_nightly.news_drift"
    )


def test_a_run_rejoining_its_lease_does_not_wait_for_its_siblings_batches(news_db):
    """A range task starting (or the setup task re-run) while a sibling's batch is in flight
    takes its run's live lease as it is, without writing the row: an UPDATE would wait for that
    batch (its fence holds the row FOR SHARE) and queue the siblings' next fences behind it."""
    from pin_nightly import jobs, news, ranges
    from pin_nightly import lease as leases
    from pin_nightly.db import connection

    ids = news_db.posts(30, drift_every=1)
    gate = _closed_gate(news_db, ids[15])
    outcome: dict = {}

    def sibling():
        try:
            with connection("news_db") as conn:
                rng, batch = news_full_sweep_range(conn, outcome["lease"], "run-1", 10)
                outcome["result"] = ranges.run_range(conn, rng, outcome["lease"], 10, batch)
        except BaseException as exc:  # noqa: BLE001
            outcome["error"] = exc

    def rejoin():
        with connection("news_db") as conn:
            outcome["rejoined"] = leases.rejoin(conn, outcome["lease"])
            outcome["again"] = leases.acquire(conn, NEWS_KEY, "deployment/run-1", 10, 5)

    with connection("news_db") as conn:
        jobs.preflight(conn, news.JOB)
        outcome["lease"] = leases.acquire(conn, NEWS_KEY, "deployment/run-1", 10, 5)
    worker = threading.Thread(target=sibling, daemon=True)
    worker.start()
    try:
        wait_for(lambda: gate_waiter(news_db) or "error" in outcome, timeout=30, what="the gate")
        assert "error" not in outcome, outcome
        other = threading.Thread(target=rejoin, daemon=True)
        other.start()
        other.join(10)
        assert not other.is_alive(), "the rejoin waited for the sibling's batch in flight"
    finally:
        gate.execute("SELECT pg_advisory_unlock(%s)", (ADVISORY_KEY,))
        gate.close()
    worker.join(30)
    remove_gate(news_db, "news.posts")
    assert outcome["rejoined"] == outcome["again"] == outcome["lease"]
    assert outcome["result"].status == "done", outcome
    assert news_db.drifted_posts() == 0


# --- 3d. missing connection, database, table, column, index -------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _break(case: str, db, monkeypatch) -> None:
    if case == "missing connection":
        monkeypatch.delenv("AIRFLOW_CONN_NEWS_DB")
    elif case == "unreachable database":
        monkeypatch.setenv(
            "AIRFLOW_CONN_NEWS_DB",
            airflow_connection(
                f"host=127.0.0.1 port={_closed_port()} dbname=news user=pin connect_timeout=3"
            ),
        )
    elif case == "missing table":
        db.q("DROP TABLE news.comments")
    elif case == "missing column":
        db.q("ALTER TABLE news.posts DROP COLUMN updated_at")


PREFLIGHT = [
    ("missing connection", "Airflow connection 'news_db' is not defined"),
    ("unreachable database", "cannot connect to the database of Airflow connection 'news_db'"),
    ("missing table", "domain table news.comments does not exist"),
    ("missing column", "domain table news.posts lacks column(s): updated_at"),
]


@pytest.mark.parametrize("case,message", PREFLIGHT, ids=[c for c, _ in PREFLIGHT])
def test_a_broken_environment_fails_at_acquire_lease_before_any_write(
    news_db, monkeypatch, capfd, caplog, case, message
):
    drifted = news_db.post(count=5, visible=3)
    counters = "SELECT id, status, comments_count FROM news.posts ORDER BY id"
    before = news_db.q(counters)
    _break(case, news_db, monkeypatch)
    capfd.readouterr()
    t0 = time.monotonic()
    r = run_dag(NEWS, FULL)
    took = time.monotonic() - t0
    text = _logs(capfd, caplog)
    assert r["state"] == "failed"
    assert r["tasks"]["validate_options"] == "success"
    assert r["tasks"]["acquire_lease"] == "failed"
    assert r["tasks"]["plan_ranges"] == "upstream_failed"
    assert message in text
    assert news_db.q(counters) == before and news_db.count(drifted) == 5
    assert news_db.one("SELECT to_regnamespace('pin_nightly') IS NULL")  # not even the job's tables
    report(f"preflight: {case}", failed_in_s=round(took, 1), message=message)


def test_catalog_missing_column_fails_at_acquire_lease(catalog_db, capfd, caplog):
    catalog_db.card(views=10)
    catalog_db.q("ALTER TABLE catalog.project_cards DROP COLUMN popularity_views")
    capfd.readouterr()
    r = run_night(CATALOG, {}, D)
    assert r["state"] == "failed" and r["tasks"]["acquire_lease"] == "failed"
    assert "domain table catalog.project_cards lacks column(s): popularity_views" in _logs(
        capfd, caplog
    )
    assert catalog_db.one("SELECT to_regclass('catalog.popularity_daily_views') IS NULL")
    assert catalog_db.one("SELECT popularity_score FROM catalog.property_object_cards") == 0


def test_missing_recommended_indexes_warn_and_the_run_succeeds(news_db, capfd, caplog):
    from tools.datagen import create_news_schema

    news_db.q("DROP SCHEMA news CASCADE")
    create_news_schema(news_db.dsn, indexes=False)
    assert (
        news_db.one(
            "SELECT count(*) FROM pg_indexes WHERE schemaname = 'news' AND indexname LIKE 'ix_%%'"
        )
        == 0
    )
    drifted = news_db.post(count=5, visible=3)
    capfd.readouterr()
    s = assert_ok(run_dag(NEWS, FULL))
    text = _logs(capfd, caplog)
    for name in ("ix_comments_post_id_visible", "ix_comments_updated_at"):
        assert f"recommended index {name} on news.comments is missing" in text
    assert news_db.count(drifted) == 3 and s["drift_corrected"] == 1


# --- 4. bad input: the catalog DAG's params ----------------------------------------------------

BAD_CATALOG_SCHEMA = [
    ({"window_days": "30"}, "window_days"),
    ({"window_days": 0}, "window_days"),
    ({"window_days": 1.5}, "window_days"),
    ({"half_life_days": 0}, "half_life_days"),
    ({"half_life_days": -7}, "half_life_days"),
    ({"half_life_days": "7"}, "half_life_days"),
    ({"batch_size": 0}, "batch_size"),
    ({"batch_size": "1000"}, "batch_size"),
    ({"batch_size": True}, "batch_size"),
    ({"max_run_duration_minutes": 0}, "max_run_duration_minutes"),
    ({"lock_ttl_minutes": "45"}, "lock_ttl_minutes"),
    ({"card_ids": ["not-a-uuid"]}, "card_ids"),
    ({"card_ids": ["0190a000-0000-7000-8000-00000000000g"]}, "card_ids"),
    ({"card_ids": [123]}, "card_ids"),
    ({"card_ids": "0190a000-0000-7000-8000-000000000000"}, "card_ids"),
    ({"dry_run": "yes"}, "dry_run"),
    ({"dry_run": 1}, "dry_run"),
    ({"max_ranges": 0}, "max_ranges"),
    ({"max_ranges": 65}, "max_ranges"),
    # values that would overflow PostgreSQL's dates, timestamps or bigints half-way through a run
    ({"window_days": 10**9}, "window_days"),
    (
        {"max_run_duration_minutes": 10**9, "lock_ttl_minutes": 2 * 10**9},
        "max_run_duration_minutes",
    ),
    (
        {"max_run_duration_minutes": float("inf"), "lock_ttl_minutes": float("inf")},
        "max_run_duration_minutes",
    ),
    ({"batch_size": 10**19}, "batch_size"),
]


@pytest.mark.parametrize(
    "conf,param", BAD_CATALOG_SCHEMA, ids=[f"{p}={c[p]!r}" for c, p in BAD_CATALOG_SCHEMA]
)
def test_catalog_invalid_conf_is_refused_by_the_params_schema(scheduler_dag, conf, param):
    from airflow.sdk.definitions.param import ParamValidationError

    params = scheduler_dag(CATALOG).params
    assert params.deep_merge({}).validate()["window_days"] == 30  # the defaults pass
    with pytest.raises(ParamValidationError, match=param):
        params.deep_merge(conf).validate()


def test_catalog_invalid_conf_creates_no_run(catalog_db):
    """End to end, one case: Airflow refuses the run before it creates it."""
    from airflow.sdk.definitions.param import ParamValidationError

    conf, param = BAD_CATALOG_SCHEMA[0]
    before = run_count(CATALOG)
    with pytest.raises(ParamValidationError, match=param):
        run_dag(CATALOG, conf)
    assert run_count(CATALOG) == before


BAD_OPTIONS = [
    (
        "catalog-ttl-below-duration",
        CATALOG,
        {"lock_ttl_minutes": 10, "max_run_duration_minutes": 20},
        "must exceed",
    ),
    (
        "catalog-ttl-equals-duration",
        CATALOG,
        {"lock_ttl_minutes": 30, "max_run_duration_minutes": 30},
        "must exceed",
    ),
]


@pytest.mark.parametrize(
    "dag_id,conf,message", [c[1:] for c in BAD_OPTIONS], ids=[c[0] for c in BAD_OPTIONS]
)
def test_inconsistent_or_out_of_range_options_fail_before_any_write(
    news_db, catalog_db, capfd, caplog, dag_id, conf, message
):
    card = catalog_db.card(views=10)
    catalog_db.seed_snapshot(card, D - timedelta(days=1), 4)
    post = news_db.post(count=5, visible=3)
    capfd.readouterr()
    r = run_night(dag_id, conf, D)
    text = _logs(capfd, caplog)
    assert r["state"] == "failed"
    assert r["tasks"]["validate_options"] == "failed"
    assert r["tasks"]["acquire_lease"] == "upstream_failed"
    assert "invalid options" in text and message in text
    assert news_db.count(post) == 5 and catalog_db.score(card) == 0
    assert catalog_db.snapshots(card) == [(D - timedelta(days=1), 4)]
    assert news_db.one("SELECT to_regnamespace('pin_nightly') IS NULL")
    assert catalog_db.one("SELECT to_regclass('pin_nightly.job_lease') IS NULL")


def test_deployment_settings_are_the_defaults_a_run_uses_and_its_conf_wins(news_db, monkeypatch):
    """A deployment sets its defaults without code (the Variable pin_nightly_<dag_id>, here as
    AIRFLOW_VAR_*), read when a run starts: a scheduled run uses them and says so in the run
    log; a value the run's conf gives wins over the setting."""
    posts = [news_db.post(count=9, visible=1) for _ in range(5)]
    settings = {"batch_size": 2, "pace_max_lock_waiters": 7}
    monkeypatch.setenv("AIRFLOW_VAR_PIN_NIGHTLY_NEWS_COMMENT_RECONCILE", json.dumps(settings))
    s = assert_ok(run_dag(NEWS, FULL))
    assert s["batches_processed"] == 3 and s["settings"] == settings  # 5 posts, 2 a batch
    assert [news_db.count(p) for p in posts] == [1] * 5
    logged = news_db.one("SELECT result FROM pin_nightly.run_log WHERE run_id = %s", s["run_id"])
    assert logged["settings"] == settings
    s = assert_ok(run_dag(NEWS, {**FULL, "batch_size": 3}))
    assert s["batches_processed"] == 2 and s["settings"] == {"pace_max_lock_waiters": 7}


@pytest.mark.parametrize(
    "value,message",
    [
        ('{"batch_size": 0}', "batch_size: "),
        ('{"post_ids": ["0190a000-0000-7000-8000-000000000001"]}', "'post_ids' is not a setting"),
        ('{"no_such_param": 1}', "'no_such_param' is not a setting"),
        ("[1, 2]", "must be a JSON object"),
        ("{batch_size: 2}", "is not JSON"),
    ],
    ids=["out-of-range", "per-run-param", "unknown", "not-an-object", "not-json"],
)
def test_bad_deployment_settings_fail_before_any_write(
    news_db, monkeypatch, capfd, caplog, value, message
):
    post = news_db.post(count=5, visible=3)
    monkeypatch.setenv("AIRFLOW_VAR_PIN_NIGHTLY_NEWS_COMMENT_RECONCILE", value)
    capfd.readouterr()
    r = run_dag(NEWS, FULL)
    text = _logs(capfd, caplog)
    assert r["tasks"]["validate_options"] == "failed", r
    assert "Variable pin_nightly_news_comment_reconcile" in text and message in text
    assert news_db.count(post) == 5
    assert news_db.one("SELECT to_regnamespace('pin_nightly') IS NULL")


def test_a_server_that_never_answers_times_out_in_seconds(monkeypatch):
    """A job connection (a named replica, the job's database) to a server that takes the TCP
    connection and never answers gives up after db.CONNECT_TIMEOUT_S, not the TCP timeout."""
    from pin_nightly.db import CONNECT_TIMEOUT_S, DatabaseUnavailable, connect

    silent = socket.create_server(("127.0.0.1", 0))  # accepts (backlog), never speaks
    port = silent.getsockname()[1]
    dsn = f"host=127.0.0.1 port={port} user=postgres dbname=x sslmode=disable"
    monkeypatch.setenv("AIRFLOW_CONN_SILENT_DB", airflow_connection(dsn))
    try:
        with pytest.raises(DatabaseUnavailable, match="timeout expired"):
            connect("silent_db")
    finally:
        silent.close()
    assert CONNECT_TIMEOUT_S <= 10


def test_fractional_minutes_are_accepted(news_db, catalog_db):
    """The duration params are numbers: 0.5 minutes is a valid run budget."""
    post = news_db.post(count=5, visible=3)
    card = catalog_db.card(views=10)
    catalog_db.seed_snapshot(card, D - timedelta(days=1), 4)
    s = assert_ok(run_dag(NEWS, {**FULL, "max_run_duration_minutes": 0.5, "lock_ttl_minutes": 1.5}))
    assert news_db.count(post) == 3 and s["backlog_remaining"] is False
    assert_ok(
        run_night(
            CATALOG,
            {"max_run_duration_minutes": 0.5, "lock_ttl_minutes": 0.75, "half_life_days": 3.5},
            D,
        )
    )
    assert catalog_db.score(card) == 6


def test_extreme_but_valid_decay_params_compute_without_overflow(catalog_db):
    """The largest window and a vanishing or infinite half-life: weights underflow to 0 or
    are all 1; nothing overflows."""
    cid = catalog_db.card(views=100)
    catalog_db.seed_snapshot(cid, D - timedelta(days=3000), 10)
    catalog_db.seed_snapshot(cid, D - timedelta(days=1), 60)
    assert_ok(run_night(CATALOG, {"window_days": 3660, "half_life_days": 1e-6}, D))
    assert catalog_db.score(cid) == 40  # only today's delta keeps a weight
    assert_ok(run_night(CATALOG, {"window_days": 3660, "half_life_days": 1e12}, D))
    assert catalog_db.score(cid) == 90  # (almost) no decay: 50 + 40


NON_FINITE = [
    ("half-life-nan", {"half_life_days": float("nan")}, "half_life_days"),
    ("half-life-inf", {"half_life_days": float("inf")}, "half_life_days"),
]


@pytest.mark.parametrize("conf,param", [c[1:] for c in NON_FINITE], ids=[c[0] for c in NON_FINITE])
def test_non_finite_numbers_fail_before_any_write(catalog_db, capfd, caplog, conf, param):
    """NaN and infinity pass the trigger-time check of dag.test() but are not JSON: the stored
    run conf holds null, and the run fails in validate_options, before any write."""
    cid = catalog_db.card(views=10)
    capfd.readouterr()
    r = run_night(CATALOG, conf, D)
    assert r["state"] == "failed" and r["tasks"]["validate_options"] == "failed"
    assert r["tasks"]["acquire_lease"] == "upstream_failed"
    assert f"Invalid input for param {param}" in _logs(capfd, caplog)
    assert catalog_db.score(cid) == 0
    assert catalog_db.one("SELECT to_regnamespace('pin_nightly') IS NULL")


# --- 4. bad data ------------------------------------------------------------------------------


def test_orphan_and_unknown_status_comments_do_not_break_the_news_job(news_db):
    """Comments whose post does not exist (recent ones too, so the DailyWindow sees them) and
    comments with a status outside the enum are ignored; a negative counter is corrected."""
    now = datetime.now(UTC)
    good = news_db.post(count=2, visible=2)
    negative = news_db.post(count=-4, visible=1)
    odd = news_db.post(count=3, visible=1, comments_at=now - timedelta(days=30))
    for status in ("visible", "Pending", "VISIBLE "):
        news_db.q(
            "INSERT INTO news.comments (id, post_id, status, created_at, updated_at) "
            "VALUES (%s, %s, %s, now(), now())",
            new_id(),
            odd,
            status,
        )
    orphans = [new_id() for _ in range(5)]
    for pid in orphans:
        news_db.q(
            "INSERT INTO news.comments (id, post_id, status, created_at, updated_at) "
            "VALUES (%s, %s, 'Visible', now(), now())",
            new_id(),
            pid,
        )
    comments_before = news_db.q("SELECT * FROM news.comments ORDER BY id")
    s = assert_ok(run_dag(NEWS, {"scope": "DailyWindow"}))
    assert s["posts_reconciled"] == 1  # only the existing post with fresh comments
    assert news_db.count(odd) == 1
    s = assert_ok(run_dag(NEWS, FULL))
    assert (news_db.count(good), news_db.count(negative), news_db.count(odd)) == (2, 1, 1)
    assert s["posts_reconciled"] == 3 and s["drift_corrected"] == 1
    assert news_db.q("SELECT * FROM news.comments ORDER BY id") == comments_before
    assert news_db.one("SELECT count(*) FROM news.posts") == 3  # no post invented for orphans


def test_snapshot_table_rejects_duplicates_and_negative_counters(catalog_db):
    cid = catalog_db.card(views=10)
    catalog_db.seed_snapshot(cid, D - timedelta(days=1), 5)
    with pytest.raises(psycopg.errors.UniqueViolation):
        catalog_db.seed_snapshot(cid, D - timedelta(days=1), 6)
    with pytest.raises(psycopg.errors.CheckViolation):
        catalog_db.seed_snapshot(cid, D - timedelta(days=2), -1)
    with pytest.raises(psycopg.errors.CheckViolation):
        catalog_db.seed_snapshot(cid, D - timedelta(days=3), 1, kind="Unknown")
    assert catalog_db.snapshots(cid) == [(D - timedelta(days=1), 5)]


def test_a_counter_reset_in_the_history_gives_delta_zero_not_a_negative_score(catalog_db):
    """Snapshots out of order in value (a later date with a smaller cumulative counter: the
    consumer's counter was reset or replayed): that day's delta is max(0, ...) = 0."""
    cid = catalog_db.card(views=60)
    dropped = catalog_db.card(views=0)  # reset to 0 today
    hist = {D - timedelta(days=3): 100, D - timedelta(days=2): 150, D - timedelta(days=1): 40}
    for d, v in hist.items():
        catalog_db.seed_snapshot(cid, d, v)
        catalog_db.seed_snapshot(dropped, d, v)
    s = assert_ok(run_night(CATALOG, {}, D))
    lam2 = Decimal(2) ** (Decimal(-2) / 7)
    assert catalog_db.score(cid) == (20 + 50 * lam2).quantize(Decimal("0.0001"))
    assert catalog_db.score(cid) == reference_popularity_score({**hist, D: 60}, D, 30, 7)
    assert catalog_db.score(dropped) == (50 * lam2).quantize(Decimal("0.0001"))
    assert s["item_errors"] == 0
