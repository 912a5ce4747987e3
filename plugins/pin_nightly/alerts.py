"""Alerts: drift spikes and deadline (SLA) misses, logged at ERROR and sent as a JSON POST to
the Airflow HTTP connection ``PIN_ALERT_CONN_ID`` (default ``pin_alerts``) through the http
provider's ``HttpNotifier``; without it they are only logged. Each names the run, links to it in
the UI and to its runbook section: docs/operations.md, "Alert channel".
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any
from urllib.parse import quote

from pin_nightly import metrics

log = logging.getLogger(__name__)

DEFAULT_CONN_ID = "pin_alerts"
NO_BASE_URL = "not available: [api] base_url (AIRFLOW__API__BASE_URL) is not set"


def base_url(conf: Any) -> str | None:
    """The deployment's ``[api] base_url`` from ``conf``: ``airflow.configuration.conf`` in the
    triggerer, ``airflow.sdk.configuration.conf`` in a task. None when it is not set."""
    try:
        value = conf.get("api", "base_url", fallback=None)
    except Exception:  # noqa: BLE001 - an unreadable setting is an unset one
        log.warning("could not read [api] base_url", exc_info=True)
        value = None
    return (value or "").strip().rstrip("/") or None


def run_url(base: str | None, dag_id: str | None, run_id: str | None) -> str:
    """The run's page in the Airflow UI, or why there is none."""
    if not base:
        return NO_BASE_URL
    if not dag_id or not run_id:
        return "not available: the alert does not know its run"
    return f"{base}/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}"


def run_fields(
    name: str,
    description: str,
    dag_id: str | None,
    run_id: str | None,
    run_state: str | None,
    base: str | None,
) -> dict[str, Any]:
    """What every alert message carries: the alert's name and a one-line description of what
    was missed, the run and its state, a link to the run and the runbook section."""
    return {
        "dag_id": dag_id,
        "run_id": run_id,
        "run_state": run_state or "unknown",
        "description": description,
        "run_url": run_url(base, dag_id, run_id),
        "runbook": f"docs/runbook.md#{name}",
    }


def _has_channel(conn_id: str) -> bool:
    from airflow.sdk import BaseHook

    try:
        BaseHook.get_connection(conn_id)
    except Exception:  # noqa: BLE001 - an absent connection means "no channel"
        return False
    return True


def notify(kind: str, payload: dict[str, Any]) -> bool:
    """Send an alert to the configured channel (a JSON POST through the http provider's
    ``HttpNotifier``); True when delivered. An alert never fails the job."""
    from airflow.providers.http.notifications.http import HttpNotifier

    conn_id = os.environ.get("PIN_ALERT_CONN_ID", DEFAULT_CONN_ID)
    body = json.loads(json.dumps({"alert": kind, **payload}, default=str))
    if not _has_channel(conn_id):
        log.error(
            "alert %s: no notification channel is set (create Airflow connection %r): %s",
            kind,
            conn_id,
            json.dumps(body),
        )
        return False
    notifier = HttpNotifier(http_conn_id=conn_id, json=body, extra_options={"timeout": 10})
    try:
        notifier.notify({})
    except Exception as exc:  # noqa: BLE001 - an alert must not fail the job
        log.error("alert %s could not be delivered to connection %r: %s", kind, conn_id, exc)
        return False
    log.info("alert %s delivered to connection %r", kind, conn_id)
    return True


def drift_alert(
    dag_id: str, run_id: str, drift_corrected: int, threshold: int, counted: str
) -> None:
    """Sent once by a run's summary when more posts than ``threshold`` were corrected
    (``counted``: since the previous nightly run's summary, or in this run)."""
    from airflow.sdk.configuration import conf

    description = (
        f"the comments_count of {drift_corrected} posts was corrected {counted}, more than the "
        f"drift_alert_threshold of {threshold}: the hot-path increment has a bug"
    )
    log.error("drift spike: %s run %s: %s (INV-CMT-005)", dag_id, run_id, description)
    name, state = "drift_above_threshold", "running"  # sent by the run's own summary task
    about = run_fields(name, description, dag_id, run_id, state, base_url(conf))
    counts = {"drift_corrected": drift_corrected, "threshold": threshold, "counted": counted}
    notify(name, {**about, **counts})
    metrics.incr("news_comment_reconcile_drift_alerts_total")
