"""Alerts: drift spikes and deadline (SLA) misses, logged at ERROR and sent to a channel.

The channel is an Airflow connection (``PIN_ALERT_CONN_ID``, default ``pin_alerts``): an HTTP
connection whose URL receives a JSON POST (a chat webhook, an Alertmanager bridge...). Without
it the alert is only logged, with a line saying that no channel is set. No secret is in code:
the URL and credentials live in the connection.
"""

from __future__ import annotations

import json
import logging
import os
import urllib.request
from typing import Any

from pin_nightly import metrics

log = logging.getLogger(__name__)

DEFAULT_CONN_ID = "pin_alerts"


def _webhook_url(conn_id: str) -> str | None:
    from airflow.sdk import BaseHook

    try:
        conn = BaseHook.get_connection(conn_id)
    except Exception:  # noqa: BLE001 - an absent connection means "no channel"
        return None
    if conn.host and conn.host.startswith(("http://", "https://")):
        base = conn.host
    elif conn.host:
        scheme = conn.schema or "http"
        base = f"{scheme}://{conn.host}" + (f":{conn.port}" if conn.port else "")
    else:
        return None
    path = conn.extra_dejson.get("endpoint", "")
    return base.rstrip("/") + ("/" + path.lstrip("/") if path else "")


def notify(kind: str, payload: dict[str, Any]) -> bool:
    """Send an alert to the configured channel; True when delivered."""
    conn_id = os.environ.get("PIN_ALERT_CONN_ID", DEFAULT_CONN_ID)
    url = _webhook_url(conn_id)
    body = {"alert": kind, **payload}
    if url is None:
        log.error("alert %s: no notification channel is set (create Airflow connection %r): %s",
                  kind, conn_id, json.dumps(body, default=str))
        return False
    req = urllib.request.Request(url, data=json.dumps(body, default=str).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310 - URL from config
            ok = 200 <= resp.status < 300
    except Exception as exc:  # noqa: BLE001 - an alert must not fail the job
        log.error("alert %s could not be delivered to connection %r: %s", kind, conn_id, exc)
        return False
    log.info("alert %s delivered to connection %r", kind, conn_id)
    return ok


def drift_alert(dag_id: str, run_id: str, result: dict[str, Any], threshold: int) -> None:
    log.error("drift spike: %s run %s corrected %s posts (threshold %s); look for a bug in the "
              "hot-path increment (INV-CMT-005)", dag_id, run_id, result["drift_corrected"],
              threshold)
    metrics.incr("news_comment_reconcile_drift_alerts_total")
    notify("drift_above_threshold", {"dag_id": dag_id, "run_id": run_id,
                                     "drift_corrected": result["drift_corrected"],
                                     "threshold": threshold})
