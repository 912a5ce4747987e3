"""Metrics reach StatsD under the specs' names, with their tags, when Airflow is configured so."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
from datetime import UTC, datetime, timedelta

import pytest

SCRIPT = textwrap.dedent("""
    # the test session's Airflow environment, inherited
    from datetime import UTC, datetime
    from tools.rundag import clear_and_resume, run_dag
    # a scheduled news run (only those set the nightly gauges), its summary then run again
    slot = datetime(2026, 1, 5, tzinfo=UTC)
    r = run_dag("news_comment_reconcile", {{"scope": "FullSweep"}}, logical_date=slot,
                run_id="scheduled__" + slot.isoformat())
    assert r["state"] == "success", r
    again = clear_and_resume("news_comment_reconcile", r["run_id"], ["summarize"],
                             only_failed=False)
    assert again["state"] == "success", again
    r = run_dag("catalog_popularity_recompute", {{}})
    assert r["state"] == "success", r
""")


def statsd_packets(script: str) -> list[str]:
    """Run ``script`` (a Python program using this repository) in a process of its own with
    Airflow's StatsD metrics sent to a local UDP listener; return the lines it received."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.5)
    packets: list[str] = []
    stop = threading.Event()

    def listen():
        while not stop.is_set():
            try:
                packets.extend(sock.recv(65535).decode().splitlines())
            except OSError:
                pass

    t = threading.Thread(target=listen, daemon=True)
    t.start()
    env = {
        **os.environ,
        "AIRFLOW__METRICS__STATSD_ON": "True",
        "AIRFLOW__METRICS__STATSD_HOST": "127.0.0.1",
        "AIRFLOW__METRICS__STATSD_PORT": str(sock.getsockname()[1]),
        "AIRFLOW__METRICS__STATSD_PREFIX": "airflow",
        "AIRFLOW__METRICS__STATSD_INFLUXDB_ENABLED": "True",
    }
    out = subprocess.run(
        [sys.executable, "-c", script.format()],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    stop.set()
    t.join(5)
    sock.close()
    assert out.returncode == 0, out.stderr[-3000:]
    return packets


@pytest.mark.long
def test_job_metrics_are_sent_to_statsd(news_db, catalog_db):
    news_db.post(count=5, visible=3)
    card = catalog_db.card(views=9)
    catalog_db.seed_snapshot(card, catalog_db.today() - timedelta(days=1), 4)
    packets = statsd_packets(SCRIPT)
    text = "\n".join(packets)
    for line in (
        "airflow.news_comment_reconcile_posts_reconciled_total:1|c",
        "airflow.news_comment_reconcile_errors_total:0|c",
        "airflow.catalog_popularity_recompute_errors_total:0|c",
        "airflow.news_comment_reconcile_drift_corrected_total:1|c",
        # the post's stored count was too high: a correction down
        "airflow.news_comment_reconcile_drift_total,direction=down:1|c",
        "airflow.news_comment_reconcile_drift_total,direction=up:0|c",
        "airflow.news_comment_reconcile_last_run_drift,direction=down:1|g",
        "airflow.news_comment_reconcile_last_run_drift,direction=up:0|g",
        "airflow.news_comment_reconcile_backlog_remaining:0|g",
        "airflow.news_comment_reconcile_drift_alert_threshold:1000|g",
        "airflow.catalog_popularity_recompute_snapshots_total,op=written:1|c",
        "airflow.catalog_popularity_recompute_cards_total,card_kind=PropertyObject:1|c",
    ):
        assert line in text, f"{line} not in {packets[:50]}"
    # the summary run again sent no counter, and the same last-success time
    assert text.count("airflow.news_comment_reconcile_drift_corrected_total:") == 1
    assert text.count("airflow.news_comment_reconcile_drift_total,direction=down:") == 1
    assert text.count("airflow.news_comment_reconcile_run_duration_ms:") == 1
    success = [p for p in packets if "news_comment_reconcile_last_success_timestamp" in p]
    assert len(success) == 2 and len(set(success)) == 1, success
    for name in (
        "airflow.news_comment_reconcile_run_duration_ms:",
        "airflow.news_comment_reconcile_last_full_sweep_timestamp_seconds:",
        "airflow.catalog_popularity_score_staleness_hours:",
        "airflow.catalog_popularity_recompute_scored_date_timestamp_seconds:",
        "airflow.catalog_popularity_recompute_last_success_timestamp_seconds:",
        "airflow.catalog_popularity_recompute_duration_seconds:",
    ):
        assert name in text, f"{name} not in {packets[:50]}"


FAILURES = textwrap.dedent("""
    # the test session's Airflow environment, inherited
    from tools.rundag import run_dag
    from pin_nightly import runs

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    real_plan, real_summarize = runs.plan, runs.summarize
    runs.plan = broken
    assert run_dag("news_comment_reconcile", {{"scope": "FullSweep"}})["state"] == "failed"
    runs.plan, runs.summarize = real_plan, broken
    assert run_dag("catalog_popularity_recompute", {{}})["state"] == "failed"
    runs.summarize = real_summarize
    # a run that stops at its time budget ends green but is not a success
    r = run_dag("news_comment_reconcile", {{"scope": "FullSweep", "batch_size": 1,
                                          "max_run_duration_minutes": 0.0001}})
    assert r["state"] == "success" and r["summary"]["status"] == "backlog_remaining", r
""")


@pytest.mark.long
def test_every_failed_task_counts_and_only_finished_work_is_a_success(news_db, catalog_db):
    """A failure in a task that is not a range task (news plan_ranges, the popularity summary)
    counts in errors_total; a news run that leaves its sweep unfinished reports the backlog
    and refreshes neither the last-success nor the last-FullSweep gauge. A popularity night
    whose summary failed after both passes completed is still seen as scored: the teardown
    sends the scored date."""
    news_db.posts(3, drift_every=1)
    catalog_db.card(views=9)
    packets = statsd_packets(FAILURES)
    text = "\n".join(packets)
    today = datetime.combine(catalog_db.today(), datetime.min.time(), UTC).timestamp()
    gauge = "airflow.catalog_popularity_recompute_scored_date_timestamp_seconds:"
    scored = [float(p[len(gauge) :].split("|")[0]) for p in packets if p.startswith(gauge)]
    assert scored == [today], scored
    assert "airflow.news_comment_reconcile_errors_total:1|c" in text
    assert "airflow.catalog_popularity_recompute_errors_total:1|c" in text
    assert "airflow.news_comment_reconcile_backlog_remaining:1|g" in text
    for name in (
        "news_comment_reconcile_last_success_timestamp_seconds",
        "news_comment_reconcile_last_full_sweep_timestamp_seconds",
        "catalog_popularity_recompute_last_success_timestamp_seconds",
    ):
        assert f"airflow.{name}:" not in text


CONFIG_ERRORS = textwrap.dedent("""
    from tools.rundag import run_dag

    for dag_id in ("news_comment_reconcile", "catalog_popularity_recompute"):
        r = run_dag(dag_id, {{"lock_ttl_minutes": 10, "max_run_duration_minutes": 20}})
        assert r["tasks"]["validate_options"] == "failed", r
""")


@pytest.mark.long
def test_a_mistyped_manual_conf_is_a_config_error_not_an_error(news_db, catalog_db):
    """A manual run refused for its conf counts in config_errors_total (no alert reads it),
    not in errors_total, which pages."""
    packets = statsd_packets(CONFIG_ERRORS)
    for dag_id in ("news_comment_reconcile", "catalog_popularity_recompute"):
        assert f"airflow.{dag_id}_config_errors_total:1|c" in packets, packets[:50]
        assert not [p for p in packets if p.startswith(f"airflow.{dag_id}_errors_total:")]


def test_with_tracing_off_a_span_costs_no_attribute_work():
    """Airflow's tracing is off in this process: the job's spans are OpenTelemetry's no-op
    ones and the attributes are never computed (the stack test covers tracing on)."""
    from pin_nightly import tracing

    calls = []
    with tracing.span("range", lambda: calls.append("start") or {"pin.job": "x"}) as span:
        tracing.set_result(span, lambda: calls.append("end") or {})
        assert not span.is_recording()
    assert calls == []


def test_a_run_is_one_job_run_span_over_its_range_and_batch_spans(monkeypatch):
    """With a tracer provider like Airflow's (its id generator takes the ids it is given): the
    setup task draws the job_run span's id, the range span opens under it, the teardown sends
    it from the acquisition with the spec's attributes, under the setup task's span."""
    from datetime import UTC, datetime

    from airflow._shared.observability.traces import OverrideableRandomIdGenerator
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pin_nightly import tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider(id_generator=OverrideableRandomIdGenerator())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("pin_nightly"))
    tracer = provider.get_tracer("airflow")
    started = datetime.now(UTC)
    with tracer.start_as_current_span("worker.acquire_lease") as setup:
        run = tracing.new_run({"jobRunId": "r1", "scope": "FullSweep", "batchSize": 5})
    assert run["parent_id"] == f"{setup.get_span_context().span_id:016x}"
    # a task in another trace (cleared into a new one) keeps its own span as the parent
    with (
        tracer.start_as_current_span("worker.elsewhere") as elsewhere,
        tracing.in_run(run),
        tracing.span("range", lambda: {}) as stray,
    ):
        assert stray.parent.span_id == elsewhere.get_span_context().span_id
    exporter.clear()
    parent = trace.set_span_in_context(
        trace.NonRecordingSpan(
            trace.SpanContext(
                int(run["trace_id"], 16), 1, is_remote=True, trace_flags=trace.TraceFlags(1)
            )
        )
    )
    with (
        tracer.start_as_current_span("worker.reconcile_range[0]", context=parent),
        tracing.in_run(run),
        tracing.span("range", lambda: {"pin.range": "FullSweep#0"}),
        tracing.span("batch", lambda: {"card_kind": "Project", "batch_size": 5}),
    ):
        pass
    tracing.end_run(run, started)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    job_run, rng, batch = spans["job_run"], spans["range"], spans["batch"]
    assert f"{job_run.context.span_id:016x}" == run["span_id"]
    assert f"{job_run.parent.span_id:016x}" == run["parent_id"]
    assert rng.parent.span_id == job_run.context.span_id
    assert batch.parent.span_id == rng.context.span_id
    assert job_run.start_time == int(started.timestamp() * 1e9) < job_run.end_time
    assert dict(job_run.attributes) == {"jobRunId": "r1", "scope": "FullSweep", "batchSize": 5}
    assert dict(batch.attributes) == {"card_kind": "Project", "batch_size": 5}
