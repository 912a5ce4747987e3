"""A real Airflow: scheduler, dag-processor, triggerer and api-server on loopback, with their
metadata on PostgreSQL. Both DAGs are triggered over the REST API, a deadline alert reaches a
webhook, a full pool makes a run wait, and one mapped task is cleared over REST and resumes."""

from __future__ import annotations

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
    s = Stack(home, env).start()
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
    assert stack.wait_run(NEWS, news_run) == "success"
    assert stack.wait_run(CATALOG, catalog_run) == "success"
    # only the runs the test triggered: no run of the latest 03:00 slot (before 03:00 UTC that
    # is yesterday's, and it would overwrite the snapshot seeded above)
    for dag_id in (NEWS, CATALOG):
        runs = stack.get(f"/api/v2/dags/{dag_id}/dagRuns")["dag_runs"]
        assert {r["run_type"] for r in runs} == {"manual"}, runs
    assert stack.news.count(drifted) == 3
    assert stack.catalog.score(card) == Decimal(30)
    summary = stack.news.one("SELECT result FROM pin_nightly.run_log WHERE run_id = %s", news_run)
    assert summary["drift_corrected"] == 1


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
    assert stack.wait_run(NEWS, within) == "success"
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
        assert "had not finished 18 s after it was queued" in msg["description"]
        assert msg["run_state"] in ("queued", "running")
    finally:
        pool(1)
    assert stack.wait_run(NEWS, late) == "success"
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
    assert stack.wait_run(CATALOG, run_id) == "success"


def test_clearing_one_mapped_task_over_rest_resumes_its_range(stack):
    db = stack.news
    db.q("TRUNCATE news.posts, news.comments")
    ids = db.posts(60, drift_every=1)
    poison = ids[45]
    db.fail_updates_of(poison)
    run_id = stack.trigger(NEWS, {"scope": "FullSweep", "batch_size": 5, "max_ranges": 3})
    assert stack.wait_run(NEWS, run_id) == "failed"
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
    stack.request(
        "POST",
        f"/api/v2/dags/{NEWS}/clearTaskInstances",
        {
            "dry_run": False,
            "only_failed": False,
            "dag_run_id": run_id,
            "task_ids": [["reconcile_range", 2]],
            "include_downstream": True,
        },
    )
    assert stack.wait_run(NEWS, run_id) == "success"
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
    helpers.install_gate(db, "news.posts", ids[27])
    gate = psycopg.connect(db.dsn, autocommit=True)
    gate.execute("SELECT pg_advisory_lock(%s)", (helpers.ADVISORY_KEY,))
    try:
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
    finally:
        gate.execute("SELECT pg_advisory_unlock(%s)", (helpers.ADVISORY_KEY,))
        gate.close()
        helpers.remove_gate(db, "news.posts")
    assert stack.wait_run(NEWS, run_id) == "failed"
    assert db.drifted_posts() > 0
    stack.request(
        "POST",
        f"/api/v2/dags/{NEWS}/clearTaskInstances",
        {"dry_run": False, "only_failed": True, "dag_run_id": run_id},
    )
    assert stack.wait_run(NEWS, run_id) == "success"
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
