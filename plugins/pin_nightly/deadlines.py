"""Deadline alerts (Airflow 3's successor of SLA callbacks) for both DAGs.

Two per DAG: a run must finish within its duration budget of being queued
(``DAGRUN_QUEUED_AT``), and a scheduled run must succeed within 26 h of its logical date
(``DAGRUN_LOGICAL_DATE``: the data is stale). Intervals come from the environment of the
scheduler / dag-processor, so that each deployment (and a test) sets its own without editing
code:

- ``PIN_<DAG_ID>_RUN_DEADLINE_SECONDS``  (news: 1800 = 20 min budget + 10; catalog: 2700)
- ``PIN_<DAG_ID>_STALE_DEADLINE_SECONDS`` (both: 93600 = 26 h)

(An Airflow Variable via ``VariableInterval`` was considered: a missing Variable makes the
creation of every run fail, so a forgotten setting would stop the job instead of its alert.)

The callbacks run in the triggerer, which imports them from this module (``plugins/`` is on its
``sys.path``). Deadlines fire after a failed run as well: the data is stale all the same.
"""

from __future__ import annotations

import asyncio
import logging
import os
from datetime import timedelta
from typing import Any

from pin_nightly import alerts, metrics

log = logging.getLogger(__name__)

STALE_SECONDS = 26 * 3600


def _seconds(dag_id: str, what: str, default: int) -> timedelta:
    name = f"PIN_{dag_id.upper()}_{what}_DEADLINE_SECONDS"
    raw = os.environ.get(name)
    if raw is None:
        return timedelta(seconds=default)
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be a whole number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return timedelta(seconds=value)


def deadline_alerts(dag_id: str, run_budget_minutes: float) -> list:
    """The DAG's two deadline alerts."""
    from airflow.sdk import AsyncCallback, DeadlineAlert, DeadlineReference

    return [
        DeadlineAlert(
            reference=DeadlineReference.DAGRUN_QUEUED_AT,
            interval=_seconds(dag_id, "RUN", int(run_budget_minutes * 60)),
            callback=AsyncCallback(deadline_missed, kwargs={"alert": "run_over_budget"}),
            name="run_over_budget",
        ),
        DeadlineAlert(
            reference=DeadlineReference.DAGRUN_LOGICAL_DATE,
            interval=_seconds(dag_id, "STALE", STALE_SECONDS),
            callback=AsyncCallback(deadline_missed, kwargs={"alert": "no_success_26h"}),
            name="no_success_26h",
        ),
    ]


def describe(alert: str, context: dict[str, Any] | None) -> dict[str, Any]:
    run = (context or {}).get("dag_run") or {}
    deadline = (context or {}).get("deadline") or {}
    state = run.get("state")
    return {
        "deadline_alert": alert,
        "dag_id": run.get("dag_id"),
        "run_id": run.get("dag_run_id") or run.get("run_id"),
        "run_state": state,
        "logical_date": run.get("logical_date"),
        "deadline": str(deadline.get("deadline_time")),
        "note": ("the run failed: its data is stale all the same" if state == "failed"
                 else "the run had not succeeded by its deadline"),
    }


async def deadline_missed(alert: str, context: dict[str, Any] | None = None, **_: Any) -> None:
    """Deadline callback (runs in the triggerer): log at ERROR, count, notify."""
    info = describe(alert, context)
    log.error("deadline missed (%(deadline_alert)s): dag=%(dag_id)s run=%(run_id)s "
              "state=%(run_state)s deadline=%(deadline)s; %(note)s", info)
    metrics.incr("pin_nightly_deadline_missed_total",
                 tags={"dag_id": str(info["dag_id"]), "alert": alert})
    await asyncio.to_thread(alerts.notify, "deadline_missed", info)
