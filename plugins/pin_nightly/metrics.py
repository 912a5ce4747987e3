"""Metrics under the specs' names, through Airflow's stats facade (StatsD or OpenTelemetry).
Every metric is declared once in :data:`METRICS`; the emitters refuse what is not declared, and
the monitoring files are tested against this table. A metric never fails a task.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

NEWS = "news_comment_reconcile"
CATALOG = "catalog_popularity_recompute"


@dataclass(frozen=True)
class Metric:
    kind: str  # counter | gauge | timer (a timer is a histogram in Prometheus)
    help: str
    tags: frozenset[str] = frozenset()


METRICS: dict[str, Metric] = {
    # news_comment_reconcile
    f"{NEWS}_posts_reconciled_total": Metric("counter", "posts read and checked by a run"),
    f"{NEWS}_drift_corrected_total": Metric(
        "counter", "comments_count values corrected, counted once from pin_nightly.news_drift"
    ),
    f"{NEWS}_drift_total": Metric(
        "counter",
        "comments_count values corrected by direction (up: was too low, down: was too high), "
        "counted once from pin_nightly.news_drift",
        frozenset({"direction"}),
    ),
    f"{NEWS}_errors_total": Metric("counter", "failed or retried task attempts"),
    f"{NEWS}_config_errors_total": Metric("counter", "manual runs refused for their conf"),
    f"{NEWS}_run_duration_ms": Metric("timer", "time from the lease to the summary"),
    f"{NEWS}_backlog_remaining": Metric("gauge", "1 when a sweep is unfinished after the run"),
    f"{NEWS}_posts_skipped_locked": Metric(
        "gauge", "posts left locked by others in the last nightly run"
    ),
    f"{NEWS}_last_run_drift_corrected": Metric(
        "gauge", "posts corrected since the previous nightly summary, targeted repairs aside"
    ),
    f"{NEWS}_last_run_drift": Metric(
        "gauge",
        "posts corrected since the previous nightly summary by direction, targeted repairs aside",
        frozenset({"direction"}),
    ),
    f"{NEWS}_drift_alert_threshold": Metric(
        "gauge", "the last nightly run's drift_alert_threshold"
    ),
    f"{NEWS}_last_full_sweep_timestamp_seconds": Metric(
        "gauge", "when the newest completed FullSweep started"
    ),
    f"{NEWS}_last_daily_window_timestamp_seconds": Metric(
        "gauge", "when the newest completed DailyWindow started"
    ),
    f"{NEWS}_last_success_timestamp_seconds": Metric(
        "gauge", "when the work of the last run that left nothing behind completed"
    ),
    f"{NEWS}_drift_alerts_total": Metric("counter", "drift alerts sent"),
    # catalog_popularity_recompute
    f"{CATALOG}_duration_seconds": Metric("timer", "time from the lease to the summary"),
    f"{CATALOG}_cards_total": Metric("counter", "cards processed", frozenset({"card_kind"})),
    f"{CATALOG}_snapshots_total": Metric(
        "counter", "snapshots written or pruned", frozenset({"op"})
    ),
    f"{CATALOG}_errors_total": Metric("counter", "failed task attempts and poison cards"),
    f"{CATALOG}_config_errors_total": Metric("counter", "manual runs refused for their conf"),
    f"{CATALOG}_backlog_remaining": Metric("gauge", "1 when a pass is unfinished after the run"),
    f"{CATALOG}_scored_date_timestamp_seconds": Metric(
        "gauge", "the newest as_of_date whose two passes completed"
    ),
    f"{CATALOG}_last_success_timestamp_seconds": Metric(
        "gauge", "when the work of the last run that left nothing behind completed"
    ),
    f"{CATALOG}_cards_unscored": Metric(
        "gauge", "cards left without tonight's score: held by others through the retry"
    ),
    "catalog_popularity_score_staleness_hours": Metric(
        "gauge", "age of the newest completely scored as_of_date at the run's end"
    ),
    # both
    "pin_nightly_deadline_missed_total": Metric(
        "counter", "missed deadlines (SLA)", frozenset({"dag_id", "alert"})
    ),
    "pin_nightly_pauses_total": Metric(
        "counter",
        "batches that waited for the database's health, by the signal over its limit",
        frozenset({"dag_id", "signal"}),
    ),
}


class UnknownMetric(ValueError):
    """A metric that is not declared in METRICS: a programming error."""


def _check(name: str, kind: str, tags: dict[str, str] | None) -> None:
    m = METRICS.get(name)
    if m is None or m.kind != kind or set(tags or {}) != m.tags:
        raise UnknownMetric(
            f"{kind} {name} with tags {sorted(tags or {})} is not declared in "
            "pin_nightly.metrics.METRICS"
        )


_EMITTERS = {"counter": "incr", "gauge": "gauge", "timer": "timing"}


def _emit(kind: str, name: str, value: float, tags: dict[str, str] | None) -> None:
    """Send a declared metric through Airflow's stats client (StatsD or OpenTelemetry)."""
    _check(name, kind, tags)
    try:
        from airflow.sdk.observability import stats

        getattr(stats, _EMITTERS[kind])(name, value, tags=tags)
    except Exception:  # noqa: BLE001 - metrics are best effort
        log.debug("metric %s not emitted", name, exc_info=True)


def incr(name: str, count: int = 1, tags: dict[str, str] | None = None) -> None:
    _emit("counter", name, count, tags)


def gauge(name: str, value: float, tags: dict[str, str] | None = None) -> None:
    _emit("gauge", name, value, tags)


def timing(name: str, ms: float, tags: dict[str, str] | None = None) -> None:
    _emit("timer", name, ms, tags)
