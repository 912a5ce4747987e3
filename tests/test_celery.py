"""Scale-out on a real CeleryExecutor: scheduler, dag-processor, triggerer and api-server (metadata
on PostgreSQL, which is also Celery's result backend), a throw-away Redis as the broker (Debian's
``redis-server``), and two Celery workers, each an ``airflow celery worker`` process of its own
with its own hostname and one task slot (concurrency 1). Each job's pool has 2 slots here, so
two ranges at once are two ranges on two workers: with more slots per worker, Celery may hand
both to one of them.

Proved on the databases, not on counters:

- a 4-range FullSweep runs its ranges on both workers, two at a time, and every post is exact,
  with each correction made once; the jobs' database sees at most 2 job connections at once and
  exactly the number of sessions docs/operations.md's "Scale-out" section states;
- a worker SIGKILLed (with every process under it) while one of its ranges is held mid-batch:
  Airflow fails the attempt on its heartbeat timeout and retries it on the surviving worker, the
  retry starts after the range's last committed batch (the range's checkpoint row and the
  retry's log), nothing is read or corrected twice, and the run ends successful;
- the same for a popularity run: snapshots and scores exact, each card snapshotted once.

The Airflow logs are in ``.airflow/celery<PIN_TEST_ID>/`` (a log file per worker there).
"""

from __future__ import annotations

import random
import shutil
import threading
import time
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from tests import helpers
from tests.conftest import SUFFIX
from tools import devenv
from tools.datagen import copy_rows
from tools.stack import CeleryStack, Redis, celery_settings, free_port, stack_env

REDIS_SERVER = helpers.require_tool(
    "redis-server", "the Celery test starts Debian's package as its broker"
)

pytestmark = pytest.mark.stack  # real Airflow components: make test-all

NEWS, CATALOG = "news_comment_reconcile", "catalog_popularity_recompute"
SLOTS = 2  # each job's pool, for this module
CONCURRENCY = 1  # each worker's
HEARTBEAT_TIMEOUT = 20  # s: a lost worker's task attempt is failed after this
RUN_TIMEOUT = 300


@pytest.fixture(scope="module")
def stack(pg_admin, tmp_path_factory):
    home = devenv.REPO / ".airflow" / f"celery{SUFFIX}"
    shutil.rmtree(home, ignore_errors=True)
    redis = Redis(tmp_path_factory.mktemp("redis"), REDIS_SERVER)
    news_dsn, catalog_dsn, metadata_dsn, conns = helpers.stack_databases("celery")
    s = None
    try:
        redis.start()
        env = stack_env(
            home,
            metadata_dsn,
            free_port(),
            {
                **conns,
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
                # a task attempt whose worker is lost is failed after HEARTBEAT_TIMEOUT and
                # retried once, 2 s later
                "AIRFLOW__CORE__DEFAULT_TASK_RETRIES": "1",
                "AIRFLOW__CORE__DEFAULT_TASK_RETRY_DELAY": "2",
                "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT),
                "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "2",
                # a task a lost worker had taken off the queue but not started yet is queued
                # again after 60 s instead of 10 minutes
                "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT": "60",
                "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT_CHECK_INTERVAL": "5",
            },
        )
        env.update(celery_settings(env, redis.url))
        s = CeleryStack(home, env, migrated=True).start()
        s.names = iter(f"w{i}" for i in range(1, 100))
        s.wait_for_dags([NEWS, CATALOG])
        two_workers(s)
        s.wait_idle([NEWS, CATALOG])
        for pool in (NEWS, CATALOG):
            s.request(
                "PATCH",
                f"/api/v2/pools/{pool}?update_mask=slots",
                {"pool": pool, "slots": SLOTS, "include_deferred": False},
            )
        s.news = helpers.NewsDB(news_dsn, psycopg.connect(news_dsn, autocommit=True))
        s.catalog = helpers.CatalogDB(catalog_dsn, psycopg.connect(catalog_dsn, autocommit=True))
        yield s
    finally:
        if s is not None:
            s.stop()
        redis.stop()


def two_workers(stack: CeleryStack) -> dict[str, str]:
    """Start workers until two are up (a replacement for one killed before); node -> name."""
    while len(stack.workers) < 2:
        stack.start_worker(next(stack.names), concurrency=CONCURRENCY)
    return {stack.node(name): name for name in stack.workers}


def mapped_tis(stack: CeleryStack, dag_id: str, run_id: str, task_id: str) -> list[dict]:
    tis = stack.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances?limit=100")
    return sorted(
        (t for t in tis["task_instances"] if t["task_id"] == task_id and t["map_index"] >= 0),
        key=lambda t: t["map_index"],
    )


def tries(stack: CeleryStack, dag_id: str, run_id: str, task_id: str, map_index: int) -> list:
    path = f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/{map_index}/tries"
    return sorted(stack.get(path)["task_instances"], key=lambda t: t["try_number"])


def task_log(stack: CeleryStack, dag_id, run_id, task_id, map_index: int, try_number: int):
    """The log lines of one attempt, as the api-server serves them."""
    path = (
        f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}"
        f"?map_index={map_index}&full_content=true"
    )
    content = stack.get(path)["content"]
    return [c.get("event", "") if isinstance(c, dict) else str(c) for c in content]


def overlapping_pairs(tis: list[dict]) -> list[tuple[int, int]]:
    spans = [
        (t["map_index"], *(datetime.fromisoformat(t[k]) for k in ("start_date", "end_date")))
        for t in tis
    ]
    return [
        (a, b)
        for i, (a, a0, a1) in enumerate(spans)
        for (b, b0, b1) in spans[i + 1 :]
        if a0 < b1 and b0 < a1
    ]


class JobConnections:
    """The jobs' connections to one database while a run goes on: how many sessions were
    opened (``pg_stat_database.sessions``) and the most open at once (``pg_stat_activity``,
    sampled every 10 ms), the test's own connections left out."""

    def __init__(self, dsn: str):
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def sessions(self) -> int:
        return self.conn.execute(
            "SELECT sessions FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()[0]

    def _sample(self) -> None:
        while not self._stop.is_set():
            n = self.conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND backend_type = 'client backend' AND pid <> pg_backend_pid() "
                "AND application_name <> 'pin-test'"
            ).fetchone()[0]
            self.peak = max(self.peak, n)
            time.sleep(0.01)

    def __enter__(self) -> JobConnections:
        time.sleep(1.5)  # statistics of sessions that just ended are flushed
        self.before = self.sessions()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        time.sleep(1.5)
        self.opened = self.sessions() - self.before
        self.conn.close()


def label_test_connection(db: helpers.NewsDB) -> None:
    db.q("SET application_name = 'pin-test'")


# --- news -------------------------------------------------------------------------------------


def news_posts(db: helpers.NewsDB, n: int, seed: int) -> tuple[list[str], dict[str, int]]:
    db.q("TRUNCATE news.posts, news.comments")
    ids, drift = helpers.bulk_posts(db, n, random.Random(seed), drift_share=0.3)
    return sorted(ids), drift


def assert_news_exact(db: helpers.NewsDB, sweep: int, drift: dict[str, int]) -> None:
    offsets = helpers.post_offsets(db)
    assert {p: o for p, o in offsets.items() if o} == {}, "posts left drifted"
    corrected = db.q(
        "SELECT post_id::text, count(*) FROM pin_nightly.news_drift WHERE sweep_id = %s "
        "GROUP BY post_id",
        sweep,
    )
    assert {p for p, _ in corrected} == set(drift), "corrections differ from the drift injected"
    assert {n for _, n in corrected} == {1}, "a post was corrected more than once"


def test_a_full_sweep_runs_its_ranges_on_both_workers_two_at_a_time(stack):
    """Range 0's batch holding a drifted post waits at a trigger until another range runs, so
    that two ranges are in flight at once whatever the timing (the ranges of this small sweep
    take well under a second each)."""
    nodes = two_workers(stack)
    db = stack.news
    label_test_connection(db)
    ids, drift = news_posts(db, 4000, seed=1)
    gated = next(p for p in ids[500:] if p in drift)
    gate = helpers.held_at_gate(db, "news.posts", gated, application_name="pin-test")
    with gate as release, JobConnections(db.dsn) as jc:
        run_id = stack.trigger(NEWS, {"scope": "FullSweep", "max_ranges": 4, "batch_size": 40})
        helpers.wait_for(
            lambda: helpers.gate_waiter(db), timeout=120, what="range 0 held at the gate"
        )
        helpers.wait_for(
            lambda: any(
                t["state"] == "running" and t["map_index"] > 0
                for t in mapped_tis(stack, NEWS, run_id, "reconcile_range")
            ),
            timeout=60,
            poll=0.2,
            what="a second range running",
        )
        release()
        stack.wait_run(NEWS, run_id, timeout=RUN_TIMEOUT, expect="success")
    tis = mapped_tis(stack, NEWS, run_id, "reconcile_range")
    assert [t["state"] for t in tis] == ["success"] * 4
    assert all(t["try_number"] == 1 for t in tis), "a range was retried"
    by_worker = {t["map_index"]: t["hostname"] for t in tis}
    print(f"\nranges by worker: {by_worker}; overlapping ranges: {overlapping_pairs(tis)}")
    assert set(by_worker.values()) == set(nodes), "the ranges did not run on both workers"
    assert overlapping_pairs(tis), "no two ranges ran at the same time"
    assert all(by_worker[a] != by_worker[b] for a, b in overlapping_pairs(tis))
    sweep = db.one("SELECT max(sweep_id) FROM pin_nightly.sweep")
    assert db.rows_per_range(sweep) == [1000] * 4  # each post read once
    assert_news_exact(db, sweep, drift)
    # what docs/operations.md's table says a 4-range run costs the jobs' database: one
    # connection per running range (never more than the pool's slots at once); in all
    # acquire_lease 1, plan_ranges 1, each range 1, summarize 2, release_lease 1
    print(f"job sessions opened: {jc.opened}, at most {jc.peak} at once")
    # never more connections at once than the pool's slots (two ranges at once are shown by
    # their run intervals above; sampling may miss the instant both connections are open)
    assert 1 <= jc.peak <= SLOTS
    assert jc.opened == 1 + 1 + 4 * 1 + 2 + 1


def test_a_worker_killed_mid_range_is_retried_on_the_other_worker_from_its_cursor(stack):
    """Range 0's batch holding post ``gated`` waits at a trigger for an advisory lock the test
    holds; its worker and every process under it are SIGKILLed."""
    nodes = two_workers(stack)
    db = stack.news
    ids, drift = news_posts(db, 2000, seed=2)
    batch = 25
    # a drifted post 60 % into range 0 (posts 0..499): batches before it are committed
    gated = next(p for p in ids[300:] if p in drift)
    with helpers.held_at_gate(db, "news.posts", gated):
        run_id = stack.trigger(NEWS, {"scope": "FullSweep", "max_ranges": 4, "batch_size": batch})
        helpers.wait_for(
            lambda: helpers.gate_waiter(db), timeout=120, what="range 0 held at the gate"
        )
        sweep = db.one("SELECT max(sweep_id) FROM pin_nightly.sweep")
        victim_ti = wait_until_none_queued(stack, NEWS, run_id, "reconcile_range", 0)
        victim = nodes[victim_ti["hostname"]]
        cursor, done_rows, done_batches = db.q(
            "SELECT cursor_id::text, rows_processed, batches FROM pin_nightly.sweep_range "
            "WHERE sweep_id = %s AND range_no = 0",
            sweep,
        )[0]
        kill(stack, victim, victim_ti)
    # mid-range: some batches committed, the held one not
    assert cursor is not None and ids[0] <= cursor < gated
    assert done_rows == ids.index(cursor) + 1 and done_batches == done_rows // batch
    stack.wait_run(NEWS, run_id, timeout=RUN_TIMEOUT, expect="success")

    survivor = next(n for n, name in nodes.items() if name != victim)
    history = tries(stack, NEWS, run_id, "reconcile_range", 0)
    print("range 0 attempts:", [(t["try_number"], t["hostname"], t["state"]) for t in history])
    assert [(t["try_number"], t["hostname"]) for t in history] == [
        (1, victim_ti["hostname"]),
        (2, survivor),
    ]
    assert history[0]["state"] in ("failed", "up_for_retry") and history[1]["state"] == "success"
    # the retry's first batch starts after the last committed one: its first checkpoint is the
    # batch_size-th post after the cursor the killed attempt had committed
    log = task_log(stack, NEWS, run_id, "reconcile_range", 0, 2)
    first = next(line for line in log if line.startswith("batch processed: "))
    assert f"cursor={ids[ids.index(cursor) + batch]} " in first, first
    # nothing read twice, nothing corrected twice, every post exact
    assert db.rows_per_range(sweep) == [500] * 4
    assert (
        db.one(
            "SELECT batches FROM pin_nightly.sweep_range WHERE sweep_id = %s AND range_no = 0",
            sweep,
        )
        == 500 // batch
    )
    assert_news_exact(db, sweep, drift)
    summary = db.one("SELECT result FROM pin_nightly.run_log WHERE run_id = %s", run_id)
    assert summary["status"] == "success" and summary["drift_corrected"] == len(drift)
    assert db.q("SELECT count(*) FROM pin_nightly.job_lease") == [(0,)]


def kill(stack: CeleryStack, victim: str, ti: dict) -> list[int]:
    """SIGKILL worker ``victim`` (running ``ti``) and every process under it."""
    import psutil

    killed = stack.kill_worker(victim)
    print(f"\nkilled {victim} ({ti['hostname']}, running {ti['task_id']}[{ti['map_index']}]):")
    print(f"  pids {killed}")
    assert len(killed) >= 4, "expected the worker, a pool process, a supervisor and the task"
    assert not [p for p in killed if psutil.pid_exists(p)]
    return killed


def wait_until_none_queued(stack, dag_id: str, run_id: str, task_id: str, map_index: int):
    """The running task instance ``task_id[map_index]``, at a moment when no task of the run is
    queued (a task a worker has taken but not started would wait for the queued timeout)."""

    def ready():
        tis = stack.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances?limit=100")
        tis = tis["task_instances"]
        if any(t["state"] == "queued" for t in tis):
            return None
        held = [t for t in tis if t["task_id"] == task_id and t["map_index"] == map_index]
        return held[0] if held and held[0]["state"] == "running" and held[0]["hostname"] else None

    return helpers.wait_for(ready, timeout=60, poll=0.2, what=f"{task_id}[{map_index}] running")


# --- catalog ----------------------------------------------------------------------------------


def test_a_popularity_run_survives_a_killed_worker(stack):
    nodes = two_workers(stack)
    db = stack.catalog
    today = db.today()
    rnd = random.Random(3)
    db.q("TRUNCATE catalog.property_object_cards, catalog.project_cards")
    devenv.run_sql_file(db.dsn, "schema/catalog_popularity.sql")  # the job's table, if absent
    db.q("TRUNCATE catalog.popularity_daily_views")
    db.partition(today - timedelta(days=4), today - timedelta(days=1))  # the nights seeded
    history: dict[str, dict] = {}
    cards, snaps = {"PropertyObject": [], "Project": []}, []
    for i in range(1240):
        kind = "Project" if i % 31 == 0 else "PropertyObject"
        cid = helpers.new_id()
        views, h = rnd.randint(0, 300), {}
        for age in (4, 3, 1):  # night D-2 missed
            h[today - timedelta(days=age)] = views
            snaps.append((kind, cid, today - timedelta(days=age), views))
            views += rnd.choice((0, 1, 5, 40, rnd.randint(0, 900)))
        h[today] = views
        history[cid] = h
        cards[kind].append((cid, "Published", views, 0, datetime(2026, 1, 1, tzinfo=UTC)))
    with psycopg.connect(db.dsn) as conn:
        for kind, rows in cards.items():
            copy_rows(
                conn,
                db.TABLES[kind],
                ("id", "status", "popularity_views", "popularity_score", "updated_at"),
                rows,
            )
        copy_rows(
            conn,
            "catalog.popularity_daily_views",
            ("card_kind", "card_id", "run_date", "cumulative_views"),
            snaps,
        )
    po = sorted(c[0] for c in cards["PropertyObject"])
    assert len(po) == 1200
    batch = 20
    # a card 60 % into range 0 (cards 0..299) whose score changes: its UPDATE waits at the gate
    gated = next(
        c for c in po[180:] if helpers.reference_popularity_score(history[c], today, 30, 7) > 0
    )
    gate = helpers.held_at_gate(db, "catalog.property_object_cards", gated)
    with gate as release, JobConnections(db.dsn) as jc:
        run_id = stack.trigger(CATALOG, {"max_ranges": 4, "batch_size": batch})
        helpers.wait_for(
            lambda: helpers.gate_waiter(db), timeout=120, what="range 0 held at the gate"
        )
        sweep = db.one(
            "SELECT sweep_id FROM pin_nightly.sweep WHERE run_id = %s AND family = "
            "'PropertyObject'",
            run_id,
        )
        victim_ti = wait_until_none_queued(stack, CATALOG, run_id, "recompute_property_objects", 0)
        victim = nodes[victim_ti["hostname"]]
        cursor, done_rows = db.q(
            "SELECT cursor_id::text, rows_processed FROM pin_nightly.sweep_range "
            "WHERE sweep_id = %s AND range_no = 0",
            sweep,
        )[0]
        kill(stack, victim, victim_ti)
        release()
        assert cursor is not None and po[0] <= cursor < gated
        assert done_rows == po.index(cursor) + 1
        stack.wait_run(CATALOG, run_id, timeout=RUN_TIMEOUT, expect="success")

    survivor = next(n for n, name in nodes.items() if name != victim)
    history0 = tries(stack, CATALOG, run_id, "recompute_property_objects", 0)
    print("range 0 attempts:", [(t["try_number"], t["hostname"], t["state"]) for t in history0])
    assert [(t["try_number"], t["hostname"]) for t in history0] == [
        (1, victim_ti["hostname"]),
        (2, survivor),
    ]
    log = task_log(stack, CATALOG, run_id, "recompute_property_objects", 0, 2)
    first = next(line for line in log if line.startswith("batch processed: "))
    assert f"cursor={po[po.index(cursor) + batch]} " in first, first
    tis = mapped_tis(stack, CATALOG, run_id, "recompute_property_objects")
    assert len(tis) == 4 and {t["hostname"] for t in tis} <= set(nodes)
    # sessions: validate_options 1, acquire_lease 1, a plan per pass 1, each range 1 (4 + 2
    # ranges), retention 2, summarize 2, release_lease 1; and 1 more per range attempt lost
    # with its worker
    projects = mapped_tis(stack, CATALOG, run_id, "recompute_projects")
    lost = sum(t["try_number"] - 1 for t in tis + projects)
    print(f"job sessions opened: {jc.opened} ({lost} range attempt(s) lost)")
    assert len(projects) == 2 and lost >= 1
    base = (4 + 2) + 9
    if lost == 1:  # the held range's attempt, which had opened its connection
        assert jc.opened == base + 1
    else:  # another attempt lost with it may have died before connecting
        assert base + 1 <= jc.opened <= base + lost
    # each card read and snapshotted once (the counters move in the batches' transactions)
    ranges = db.q(
        "SELECT rows_processed, rows_written FROM pin_nightly.sweep_range WHERE sweep_id = %s "
        "ORDER BY range_no",
        sweep,
    )
    assert ranges == [(300, 300)] * 4
    # snapshots and scores exact
    snapped = dict(
        db.q(
            "SELECT card_id::text, cumulative_views FROM catalog.popularity_daily_views "
            "WHERE run_date = %s",
            today,
        )
    )
    assert snapped == {cid: h[today] for cid, h in history.items()}
    for kind, rows in cards.items():
        scores = dict(db.q(f"SELECT id::text, popularity_score FROM {db.TABLES[kind]}"))
        for cid, *_ in rows:
            assert scores[cid] == helpers.reference_popularity_score(history[cid], today, 30, 7), (
                cid
            )
    summary = db.one("SELECT result FROM pin_nightly.run_log WHERE run_id = %s", run_id)
    assert summary["status"] == "success" and summary["snapshots_written"] == 1240
    assert db.q("SELECT count(*) FROM pin_nightly.job_lease") == [(0,)]
