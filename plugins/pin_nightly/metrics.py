"""Metrics under the specs' names, through Airflow's stats facade (StatsD or OpenTelemetry, as
Airflow is configured). Emitting a metric never fails a task."""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


def _stats():
    from airflow.sdk.observability import stats

    return stats


def incr(name: str, count: int = 1, tags: dict[str, str] | None = None) -> None:
    try:
        _stats().incr(name, count, tags=tags)
    except Exception:  # noqa: BLE001 - metrics are best effort
        log.debug("metric %s not emitted", name, exc_info=True)


def gauge(name: str, value: float, tags: dict[str, str] | None = None) -> None:
    try:
        _stats().gauge(name, value, tags=tags)
    except Exception:  # noqa: BLE001
        log.debug("metric %s not emitted", name, exc_info=True)


def timing(name: str, ms: float, tags: dict[str, str] | None = None) -> None:
    try:
        _stats().timing(name, ms, tags=tags)
    except Exception:  # noqa: BLE001
        log.debug("metric %s not emitted", name, exc_info=True)


def last_success(job_metric_prefix: str) -> None:
    """Unix time of the job's last successful run, for alerting outside Airflow."""
    gauge(f"{job_metric_prefix}_last_success_timestamp_seconds", time.time())
