"""A real Airflow: scheduler, dag-processor, triggerer and api-server on loopback, with their
metadata on PostgreSQL. Both DAGs are triggered over the REST API, a deadline alert reaches a
webhook, a full pool makes a run wait, and one mapped task is cleared over REST and resumes."""

from __future__ import annotations

import functools
import gzip
import threading
import time
from datetime import timedelta
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psycopg
import pytest

from tests import helpers
from tests.conftest import SUFFIX
from tools import devenv
from tools.stack import Stack, free_port, stack_env

pytestmark = pytest.mark.stack  # real Airflow components: make test-all

NEWS, CATALOG = "news_comment_reconcile", "catalog_popularity_recompute"


class OtlpReceiver:
    """A local OTLP/HTTP trace receiver: what Airflow's exporter sends, decoded into spans."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        spans = self.spans = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                req = ExportTraceServiceRequest.FromString(body)
                for rs in req.resource_spans:
                    for ss in rs.scope_spans:
                        spans.extend(_span_dict(sp) for sp in ss.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def _span_dict(sp) -> dict:
    def value(v):
        kind = v.WhichOneof("value")
        return getattr(v, kind) if kind else None

    return {
        "name": sp.name,
        "trace_id": sp.trace_id.hex(),
        "span_id": sp.span_id.hex(),
        "parent": sp.parent_span_id.hex(),
        "status": sp.status.code,
        "events": [e.name for e in sp.events],
        "attributes": {a.key: value(a.value) for a in sp.attributes},
    }


@pytest.fixture(scope="module")
def stack(pg_admin):
    home = devenv.REPO / ".airflow" / f"e2e{SUFFIX}"
    news_dsn, catalog_dsn, metadata_dsn, conns = helpers.stack_databases("e2e")
    hook = helpers.Webhook()
    otlp = OtlpReceiver()
    env = stack_env(
        home,
        metadata_dsn,
        free_port(),
        {
            **conns,
            "AIRFLOW_CONN_PIN_ALERTS": hook.connection(),
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
            # every news run misses its run budget: proves the deadline path end to end
            "PIN_NEWS_COMMENT_RECONCILE_RUN_DEADLINE_SECONDS": "2",
            # a worker lost without a word is failed after 30 s instead of 5 minutes
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "30",
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "5",
            # Airflow's tracing on, exported over OTLP/HTTP to the receiver above
            "AIRFLOW__TRACES__OTEL_ON": "True",
            "OTEL_TRACES_EXPORTER": "otlp_proto_http",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": otlp.endpoint,
            "OTEL_SERVICE_NAME": "airflow",
            "OTEL_BSP_SCHEDULE_DELAY": "500",
        },
    )
    s = Stack(home, env, migrated=True).start()
    try:
        s.wait_for_dags([NEWS, CATALOG])
        s.news = helpers.NewsDB(news_dsn, psycopg.connect(news_dsn, autocommit=True))
        s.catalog = helpers.CatalogDB(catalog_dsn, psycopg.connect(catalog_dsn, autocommit=True))
        s.hook = hook
        s.otlp = otlp
        yield s
    finally:
        s.stop()
        hook.server.shutdown()
        otlp.server.shutdown()


def test_both_dags_run_through_the_scheduler(stack):
    drifted = stack.news.post(count=5, visible=3)
    card = stack.catalog.card(views=40)
    stack.catalog.seed_snapshot(card, stack.catalog.today() - timedelta(days=1), 10)
    news_run = stack.trigger(NEWS, {"scope": "FullSweep"})
    catalog_run = stack.trigger(CATALOG)
    stack.wait_run(NEWS, news_run, expect="success")
    stack.wait_run(CATALOG, catalog_run, expect="success")
    # only the runs the test triggered: no run of the latest 03:00 slot (before 03:00 UTC that
    # is yesterday's, and it would overwrite the snapshot seeded above)
    for dag_id in (NEWS, CATALOG):
        runs = stack.get(f"/api/v2/dags/{dag_id}/dagRuns")["dag_runs"]
        assert {r["run_type"] for r in runs} == {"manual"}, runs
    assert stack.news.count(drifted) == 3
    assert stack.catalog.score(card) == Decimal(30)
    summary = stack.news.one("SELECT result FROM pin_nightly.run_log WHERE run_id = %s", news_run)
    assert summary["drift_corrected"] == 1
    # the scheduler's listener notes the outcome on the run, which the grid shows
    note = stack.get(f"/api/v2/dags/{NEWS}/dagRuns/{news_run}")["note"]
    assert (
        note
        == f"success: FullSweep, {summary['posts_reconciled']} posts checked, 1 corrected, 0 failed"
    )


def test_invalid_conf_is_rejected_by_the_rest_api(stack):
    before = stack.get(f"/api/v2/dags/{NEWS}/dagRuns")["total_entries"]
    with pytest.raises(RuntimeError, match=r"HTTP 400.*batch_size"):
        stack.trigger(NEWS, {"batch_size": "10"})
    assert stack.get(f"/api/v2/dags/{NEWS}/dagRuns")["total_entries"] == before


def test_a_deadline_miss_reaches_the_webhook(stack):
    hits = stack.hook.wait_for(
        lambda r: (
            r.get("alert") == "deadline_missed"
            and r.get("deadline_alert") == "run_over_budget"
            and r.get("dag_id") == NEWS
        )
    )
    assert hits[0]["run_id"] and hits[0]["run_state"] in ("running", "success", "queued")
    assert "deadline" in hits[0]


def test_a_run_with_a_budget_of_its_own_is_over_budget_only_past_it(stack):
    """run_over_budget fires at the DAG's default budget (2 s in this stack); a run whose conf
    gives it a larger one (lock_ttl_minutes) is reported only when it has not finished within
    its own, with that budget in the message."""

    def over_budget(run_id: str) -> list:
        return [
            r
            for r in stack.hook.received
            if r.get("deadline_alert") == "run_over_budget" and r.get("run_id") == run_id
        ]

    own = {"scope": "FullSweep", "lock_ttl_minutes": 3, "max_run_duration_minutes": 2}
    within = stack.trigger(NEWS, own)
    stack.wait_run(NEWS, within, expect="success")
    pool = lambda n: stack.request(  # noqa: E731
        "PATCH",
        f"/api/v2/pools/{NEWS}?update_mask=slots",
        {"pool": NEWS, "slots": n, "include_deferred": False},
    )
    pool(0)  # the next run cannot start: it overruns its 18 s
    try:
        late = stack.trigger(
            NEWS, {**own, "lock_ttl_minutes": 0.3, "max_run_duration_minutes": 0.2}
        )
        [msg] = helpers.wait_for(lambda: over_budget(late), timeout=120, what="the alert")
        assert "had not finished 18 s after it started" in msg["description"]
        assert msg["run_state"] in ("queued", "running")
    finally:
        pool(1)
    stack.wait_run(NEWS, late, expect="success")
    # the first run ended well within its own 3 minutes, long before the alert above
    assert over_budget(within) == []


def test_a_run_waits_while_its_pool_is_full(stack):
    set_slots = lambda n: stack.request(  # noqa: E731
        "PATCH",
        f"/api/v2/pools/{CATALOG}?update_mask=slots",
        {"pool": CATALOG, "slots": n, "include_deferred": False},
    )
    set_slots(0)
    try:
        run_id = stack.trigger(CATALOG)
        time.sleep(8)
        assert stack.run_state(CATALOG, run_id) in ("queued", "running")
        states = stack.task_states(CATALOG, run_id)
        assert states.get("validate_options") in (None, "scheduled", "queued")
    finally:
        set_slots(1)
    stack.wait_run(CATALOG, run_id, expect="success")


def _clear_news_range(stack, run_id: str, map_index: int) -> None:
    """The UI's Clear of one mapped range task instance (with its downstream tasks)."""
    stack.request(
        "POST",
        f"/api/v2/dags/{NEWS}/clearTaskInstances",
        {
            "dry_run": False,
            "only_failed": False,
            "dag_run_id": run_id,
            "task_ids": [["reconcile_range", map_index]],
            "include_downstream": True,
        },
    )


def test_clearing_one_mapped_task_over_rest_resumes_its_range(stack):
    db = stack.news
    db.q("TRUNCATE news.posts, news.comments")
    ids = db.posts(60, drift_every=1)
    poison = ids[45]
    db.fail_updates_of(poison)
    run_id = stack.trigger(NEWS, {"scope": "FullSweep", "batch_size": 5, "max_ranges": 3})
    stack.wait_run(NEWS, run_id, expect="failed")
    states = stack.task_states(NEWS, run_id)
    assert states["reconcile_range[2]"] == "failed"
    assert states["reconcile_range[0]"] == states["reconcile_range[1]"] == "success"
    sweep = db.one("SELECT max(sweep_id) FROM pin_nightly.sweep")
    cursor = db.one(
        "SELECT cursor_id::text FROM pin_nightly.sweep_range WHERE sweep_id = %s AND range_no = 2",
        sweep,
    )
    assert ids[40] <= cursor < poison
    db.allow_updates()
    _clear_news_range(stack, run_id, 2)
    stack.wait_run(NEWS, run_id, expect="success")
    assert db.rows_per_range(sweep) == [20, 20, 20]  # the range resumed; nothing read twice
    assert db.drifted_posts() == 0
    assert db.q("SELECT count(*) FROM pin_nightly.job_lease") == [(0,)]
    _assert_traces(stack, run_id, sweep, ids, poison)


def _assert_traces(stack, run_id: str, sweep: int, ids: list[str], poison: str) -> None:
    """The run's trace: Airflow's dag_run span, its task spans, the job's job_run span under the
    setup task's, and under it each range span with its batch spans; the failure is recorded on
    its spans."""

    def of_run():
        ranges = [
            s
            for s in stack.otlp.spans
            if s["name"] == "range" and s["attributes"].get("pin.job_run_id") == run_id
        ]
        runs = [
            s
            for s in stack.otlp.spans
            if s["name"] == f"dag_run.{NEWS}"
            and s["attributes"].get("airflow.dag_run.run_id") == run_id
        ]
        jobs = [
            s
            for s in stack.otlp.spans
            if s["name"] == "job_run" and s["attributes"].get("jobRunId") == run_id
        ]
        return (ranges, runs, jobs) if (len(ranges), len(runs), len(jobs)) == (4, 2, 2) else None

    ranges, runs, jobs = helpers.wait_for(of_run, timeout=60, what="the run's spans")
    spans = stack.otlp.spans
    by_id = {s["span_id"]: s for s in spans}
    # the failed run (status error) and its re-run after the clear are one trace each
    first, rerun = sorted(runs, key=lambda s: s["status"] != 2)
    assert (first["status"], rerun["status"]) == (2, 1)
    assert first["trace_id"] != rerun["trace_id"]
    # a job_run span per trace (the spec's run span), under the setup task's span
    for job in jobs:
        a = job["attributes"]
        assert (a["correlationId"], a["scope"], a["batchSize"]) == (run_id, "FullSweep", 5)
        assert by_id[job["parent"]]["name"] == "worker.acquire_lease"
    assert {j["trace_id"] for j in jobs} == {first["trace_id"], rerun["trace_id"]}
    for rng in ranges:
        parent = by_id[rng["parent"]]
        no = rng["attributes"]["pin.range_no"]
        assert parent["name"] == "job_run" and parent["trace_id"] == rng["trace_id"]
        a = rng["attributes"]
        assert (a["pin.job"], a["pin.sweep_id"], a["pin.scope"], a["pin.batch_size"]) == (
            NEWS,
            sweep,
            "FullSweep",
            5,
        )
        assert a["pin.range"].startswith(f"FullSweep#{no} (")
    batches = lambda rng: sorted(  # noqa: E731
        (s for s in spans if s["parent"] == rng["span_id"] and s["name"] == "batch"),
        key=lambda s: s["attributes"].get("pin.batch.after_id", ""),
    )
    failed = [r for r in ranges if r["status"] == 2]  # STATUS_CODE_ERROR
    assert len(failed) == 1 and failed[0]["attributes"]["pin.range_no"] == 2
    last = batches(failed[0])[-1]
    assert last["status"] == 2 and "exception" in last["events"]
    assert "pin.batch.rows" not in last["attributes"]  # its transaction was rolled back
    resumed = [r for r in ranges if r["attributes"]["pin.range_no"] == 2 and r["status"] != 2]
    assert len(resumed) == 1 and resumed[0]["trace_id"] == rerun["trace_id"]
    chain, span = [], resumed[0]
    while span["parent"] in by_id:
        span = by_id[span["parent"]]
        chain.append(span["name"])
    assert chain == [
        "job_run",
        "worker.acquire_lease",
        "task_run.acquire_lease",
        f"dag_run.{NEWS}",
    ]
    assert {r["trace_id"] for r in ranges if r is not resumed[0]} == {first["trace_id"]}
    assert batches(failed[0])[0]["attributes"]["pin.batch.after_id"] == ids[39]
    # the cleared range starts after its last committed batch
    assert batches(resumed[0])[0]["attributes"]["pin.batch.after_id"] == ids[44]
    done = [
        b["attributes"] for r in ranges for b in batches(r) if "pin.batch.rows" in b["attributes"]
    ]
    assert sum(b["pin.batch.rows"] for b in done) == 60  # each post read once
    assert sum(b["pin.batch.updated_count"] for b in done) == 60
    assert all(b["updated_count"] == b["pin.batch.updated_count"] for b in done)
    assert all(b["batch_size"] == 5 for b in done)
    assert all(b["pin.batch.cursor"] for b in done if b["pin.batch.rows"])


def test_a_worker_killed_mid_batch_then_clear_failed_finishes_the_run(stack):
    """The task process of a range is SIGKILLed while its batch is in flight (held by a trigger
    that waits for an advisory lock the test holds). Airflow fails the task; the data team then
    clears the run's failed tasks ("only failed": acquire_lease is not re-run, so the range takes
    the run's lease again). The run ends successful, every post exact, each corrected once."""
    import os
    import signal

    import psutil

    db = stack.news
    db.q("TRUNCATE news.posts, news.comments")
    ids = db.posts(40, drift_every=1)
    with helpers.held_at_gate(db, "news.posts", ids[27]):
        run_id = stack.trigger(NEWS, {"scope": "FullSweep", "batch_size": 4, "max_ranges": 2})
        helpers.wait_for(
            lambda: helpers.gate_waiter(db), timeout=120, what="a batch held at the gate"
        )
        tis = stack.get(f"/api/v2/dags/{NEWS}/dagRuns/{run_id}/taskInstances?limit=100")
        running = [
            t["id"]
            for t in tis["task_instances"]
            if t["task_id"] == "reconcile_range" and t["state"] == "running"
        ]
        assert len(running) == 1, tis
        victims = [
            p
            for p in psutil.process_iter(["cmdline"])
            if any(running[0] in part for part in (p.info["cmdline"] or []))
        ]
        assert victims, f"no task process titled with {running[0]}"
        for p in victims:
            os.kill(p.pid, signal.SIGKILL)
    stack.wait_run(NEWS, run_id, expect="failed")
    assert db.drifted_posts() > 0
    stack.request(
        "POST",
        f"/api/v2/dags/{NEWS}/clearTaskInstances",
        {"dry_run": False, "only_failed": True, "dag_run_id": run_id},
    )
    stack.wait_run(NEWS, run_id, expect="success")
    assert db.drifted_posts() == 0
    sweep = db.one("SELECT max(sweep_id) FROM pin_nightly.sweep")
    assert db.q(
        "SELECT count(*), count(DISTINCT post_id) FROM pin_nightly.news_drift WHERE sweep_id = %s",
        sweep,
    ) == [(40, 40)]
    assert db.q("SELECT status FROM pin_nightly.sweep WHERE sweep_id = %s", sweep) == [("done",)]
    assert db.q("SELECT count(*) FROM pin_nightly.job_lease") == [(0,)]
    summary = db.one("SELECT result FROM pin_nightly.run_log WHERE run_id = %s", run_id)
    assert summary["status"] == "success" and summary["backlog_remaining"] is False


def _fresh_catalog(stack) -> helpers.CatalogDB:
    """The stack's catalog database without cards, snapshots or job history (the tests before
    left passes of today, which would make older nights write nothing)."""
    db = stack.catalog
    db.q("DROP SCHEMA IF EXISTS pin_nightly CASCADE")
    devenv.run_sql_file(db.dsn, "schema/pin_nightly.sql")
    devenv.run_sql_file(db.dsn, "schema/catalog_popularity.sql")
    db.q("TRUNCATE catalog.property_object_cards, catalog.project_cards")
    db.q("TRUNCATE catalog.popularity_daily_views")
    return db


def _slow_batches(db) -> None:
    """Every popularity batch takes 2 s longer (its snapshot upsert sleeps once)."""
    db.q(
        "CREATE OR REPLACE FUNCTION catalog.slow_batch() RETURNS trigger LANGUAGE plpgsql AS "
        "$$BEGIN PERFORM pg_sleep(2); RETURN NULL; END$$"
    )
    db.q(
        "CREATE TRIGGER slow_batch BEFORE INSERT ON catalog.popularity_daily_views "
        "FOR EACH STATEMENT EXECUTE FUNCTION catalog.slow_batch()"
    )


def _set_slots(stack, n: int, pool: str = CATALOG) -> None:
    stack.request(
        "PATCH",
        f"/api/v2/pools/{pool}?update_mask=slots",
        {"pool": pool, "slots": n, "include_deferred": False},
    )


def _trigger_night(stack, d, conf: dict) -> str:
    run = stack.request(
        "POST",
        f"/api/v2/dags/{CATALOG}/dagRuns",
        {"logical_date": helpers.night(d).isoformat(), "conf": conf},
    )
    return run["dag_run_id"]


def test_a_backfill_of_missed_nights_through_the_rest_api(stack):
    """``POST /api/v2/backfills`` of the missed nights D-3 to D-1 (newest snapshot D-4): the
    runs of D-3 and D-2 fail in validate_options before writing; D-1 (yesterday) writes."""
    db = _fresh_catalog(stack)
    today = db.today()
    card = db.card(views=500)
    db.seed_snapshot(card, today - timedelta(days=4), 100)
    stack.request(
        "POST",
        "/api/v2/backfills",
        {
            "dag_id": CATALOG,
            "from_date": helpers.night(today - timedelta(days=3)).isoformat(),
            "to_date": helpers.night(today - timedelta(days=1)).isoformat(),
            "max_active_runs": 1,
        },
    )

    def ended():
        runs = stack.get(f"/api/v2/dags/{CATALOG}/dagRuns?run_type=backfill&limit=10")
        runs = runs["dag_runs"]
        done = len(runs) == 3 and all(r["state"] in ("success", "failed") for r in runs)
        return {r["logical_date"][:10]: r for r in runs} if done else None

    runs = helpers.wait_for(ended, timeout=300, poll=2, what="the backfill's three runs")
    for back in (3, 2):
        r = runs[(today - timedelta(days=back)).isoformat()]
        assert r["state"] == "failed", r
        assert stack.task_states(CATALOG, r["dag_run_id"])["validate_options"] == "failed"
    assert runs[(today - timedelta(days=1)).isoformat()]["state"] == "success"
    assert db.snapshots(card) == [
        (today - timedelta(days=4), 100),
        (today - timedelta(days=1), 500),
    ]


def _ranges_at_once(stack, run_id: str) -> int:
    """The most range tasks of the run's first pass that were running at one instant."""
    tis = stack.get(f"/api/v2/dags/{CATALOG}/dagRuns/{run_id}/taskInstances?limit=100")
    spans = [
        (t["start_date"], t["end_date"])
        for t in tis["task_instances"]
        if t["task_id"] == "recompute_property_objects" and t["start_date"] and t["end_date"]
    ]
    return max((sum(a <= s < b for a, b in spans) for s, _ in spans), default=0)


def test_four_pool_slots_cut_by_the_budget_reach_every_card(stack):
    """Four pool slots, four ranges run at once by the LocalExecutor, batches slowed so that
    the budget ends before the ranges do: each night goes on from every range's cursor, so
    within a few nights every card has a snapshot and its exact score (before, only the first
    range went on; the tails of the others were never reached, however many nights ran). How
    many nights it takes depends on the machine's speed; the first never reaches every card."""
    db = _fresh_catalog(stack)
    # no projects: the property-object pass has the whole budget (the order of the passes under
    # cuts is tested in tests/test_coverage.py)
    cards = {db.card(views=i): "PropertyObject" for i in range(80)}
    _slow_batches(db)
    set_slots = functools.partial(_set_slots, stack)
    set_slots(4)
    conf = {"batch_size": 2, "max_ranges": 4, "max_run_duration_minutes": 0.3}
    today = db.today()
    at_once, unreached = 0, []
    try:
        for k in range(20, 6, -1):  # up to 14 nights, none the backfill test above ran
            for table in db.TABLES.values():
                db.q(f"UPDATE {table} SET popularity_views = popularity_views + 3")
            db.set_today(today - timedelta(days=k))  # the night, as of its date
            run_id = _trigger_night(stack, today - timedelta(days=k), conf)
            stack.wait_run(CATALOG, run_id, timeout=240, expect="success")
            at_once = max(at_once, _ranges_at_once(stack, run_id))
            unreached.append(sum(not db.snapshots(cid) for cid in cards))
            if not unreached[-1]:
                break
    finally:
        set_slots(1)
        db.set_today(None)
        db.q("DROP TRIGGER slow_batch ON catalog.popularity_daily_views")
    assert unreached[0] > 0, "the first night was cut by its budget"
    assert unreached[-1] == 0, f"cards never reached after {len(unreached)} nights: {unreached}"
    assert at_once >= 3, "ranges of one night ran at once"
    for cid, kind in cards.items():
        snaps = dict(db.snapshots(cid))
        newest = max(snaps)
        assert db.score(cid, kind) == helpers.reference_popularity_score(snaps, newest, 30, 7)


def _control(db, sweep_id: int, action: str) -> None:
    """A control of the news sweep, as the console gives it (on the job's database)."""
    from pin_nightly import controls, news

    with psycopg.connect(db.dsn) as conn:
        controls.give(conn, news.JOB, sweep_id, action, "on-call")


def test_clearing_one_range_while_its_siblings_run_keeps_the_runs_lease(stack):
    """One of four ranges running at once fails; the on-call clears it as soon as the grid
    shows its downstream tasks marked (its setup task, acquire_lease, runs again) while the
    others still run. The lease is re-joined as it
    is: the siblings are not fenced out (before, they failed with LeaseLost), the cleared range
    resumes from its cursor and the run ends successful with every post exact. Whatever the
    machine's load, the siblings are held: in their first batch at a gate until the range has
    failed, then (a batch holds the lease row FOR SHARE, so acquire_lease would wait for it)
    paused between batches until acquire_lease has run again. (News: its run deadline in this
    stack is 2 s, and Airflow 3.3.2 answers a clear of a run whose DAGRUN_QUEUED_AT deadline
    has not passed yet with HTTP 500, see docs/design.md.)"""
    db = stack.news
    db.q("TRUNCATE news.posts, news.comments")
    ids = db.posts(80, drift_every=1)
    first_of_last = ids[60]  # the first post of the last of four ranges
    db.q("CREATE TABLE IF NOT EXISTS public.gate (open boolean NOT NULL, fail boolean NOT NULL)")
    db.q("TRUNCATE public.gate")
    db.q("INSERT INTO public.gate VALUES (false, true)")
    db.q(  # flags, not DDL: dropping a trigger would wait for the batches it holds; a sleep,
        # not a lock: no lock_timeout
        "CREATE OR REPLACE FUNCTION news.gate() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        f"IF NEW.id = '{first_of_last}' AND (SELECT fail FROM public.gate) THEN "
        "RAISE EXCEPTION 'disk full (simulated)' USING ERRCODE = 'disk_full'; END IF; "
        f"IF NEW.id < '{first_of_last}' THEN "
        "LOOP EXIT WHEN (SELECT open FROM public.gate); PERFORM pg_sleep(0.2); END LOOP; "
        "END IF; RETURN NEW; END $$"
    )
    db.q(
        "CREATE TRIGGER gate BEFORE UPDATE ON news.posts FOR EACH ROW EXECUTE FUNCTION news.gate()"
    )
    pool = functools.partial(_set_slots, stack, pool=NEWS)
    pool(4)
    try:
        run_id = stack.trigger(NEWS, {"scope": "FullSweep", "batch_size": 2, "max_ranges": 4})
        siblings = [f"reconcile_range[{i}]" for i in range(3)]

        def held() -> bool:
            # the summary (all_done) waits for the siblings: nothing downstream of the failure
            # is marked meanwhile, so a clear made at once is not undone by the scheduler
            states = stack.task_states(NEWS, run_id)
            return (
                states.get("reconcile_range[3]") == "failed"
                and states.get("summarize") in (None, "none")
                and all(states.get(t) == "running" for t in siblings)
            )

        helpers.wait_for(
            held, timeout=180, poll=0.5, what="range 3 failed, its downstream marked, 0-2 running"
        )
        sweep = db.one("SELECT sweep_id FROM pin_nightly.sweep WHERE status = 'open'")
        _control(db, sweep, "pause")
        db.q("UPDATE public.gate SET open = true, fail = false")
        _clear_news_range(stack, run_id, 3)

        def rejoined() -> bool:
            tis = stack.get(f"/api/v2/dags/{NEWS}/dagRuns/{run_id}/taskInstances?limit=100")
            (lease,) = [t for t in tis["task_instances"] if t["task_id"] == "acquire_lease"]
            return lease["try_number"] >= 2 and lease["state"] == "success"

        helpers.wait_for(rejoined, timeout=180, poll=0.5, what="acquire_lease to run again")
        states = stack.task_states(NEWS, run_id)
        assert all(states[t] == "running" for t in siblings), states
        _control(db, sweep, "resume")
        stack.wait_run(NEWS, run_id, timeout=240, expect="success")
    finally:
        pool(1)
        db.q("UPDATE public.gate SET open = true, fail = false")
        db.q("UPDATE pin_nightly.sweep_control SET paused = false")
        db.q("DROP TRIGGER IF EXISTS gate ON news.posts")
    tis = stack.get(f"/api/v2/dags/{NEWS}/dagRuns/{run_id}/taskInstances?limit=100")
    tries = {
        t["map_index"]: (t["state"], t["try_number"])
        for t in tis["task_instances"]
        if t["task_id"] == "reconcile_range"
    }
    assert tries == {0: ("success", 1), 1: ("success", 1), 2: ("success", 1), 3: ("success", 2)}
    assert db.drifted_posts() == 0
    summary = db.one("SELECT result FROM pin_nightly.run_log WHERE run_id = %s", run_id)
    assert [(c["action"], c["given_by"]) for c in summary["controls"]] == [
        ("pause", "on-call"),
        ("resume", "on-call"),
    ]
