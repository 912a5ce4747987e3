"""Deadline alerts (Airflow 3's successor of SLA callbacks) for both DAGs: a run must finish
within its duration budget of starting (the alert is set from ``DAGRUN_QUEUED_AT``; its
callback waits for a run that queued behind another), and a scheduled run must
succeed within 26 h of its logical date (``DAGRUN_LOGICAL_DATE``). Intervals come from the
environment (``PIN_<DAG_ID>_{RUN,STALE}_DEADLINE_SECONDS``: an Airflow Variable that is missing
would make the creation of every run fail). The callbacks run in the triggerer (``plugins/`` is
on its ``sys.path``). What they send: docs/operations.md, "Deadline (SLA) alerts".
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from datetime import UTC, datetime, timedelta
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
    """The DAG's two deadline alerts, each calling :func:`deadline_missed` with its name and
    interval."""
    from airflow.sdk import AsyncCallback, DeadlineAlert, DeadlineReference

    kinds = (
        ("run_over_budget", DeadlineReference.DAGRUN_QUEUED_AT, "RUN", run_budget_minutes * 60),
        ("no_success_26h", DeadlineReference.DAGRUN_LOGICAL_DATE, "STALE", STALE_SECONDS),
    )
    out = []
    for name, reference, what, default in kinds:
        interval = _seconds(dag_id, what, int(default))
        kwargs = {"alert": name, "interval_seconds": int(interval.total_seconds())}
        callback = AsyncCallback(deadline_missed, kwargs=kwargs)
        out.append(
            DeadlineAlert(reference=reference, interval=interval, callback=callback, name=name)
        )
    return out


# what each deadline means, in one line ({span}: its interval in this deployment)
MISSED = {
    "run_over_budget": "the run had not finished {span} after it started (its time budget "
    "and a margin)",
    "no_success_26h": "the run had not succeeded {span} after its logical date {logical_date}: "
    "the job's data is stale",
}


def _span(seconds: float | None) -> str:
    """93600 -> '26 h', 2700 -> '45 min', 200 -> '3 min 20 s'."""
    if seconds is None:  # a deadline created before the interval was passed to its callback
        return "in time"
    s = int(seconds)
    parts = [(s // 3600, "h"), (s % 3600 // 60, "min"), (s % 60, "s")]
    return " ".join(f"{n} {unit}" for n, unit in parts if n) or "0 s"


def _iso(value: Any) -> str | None:
    if value is None:
        return None
    return value.isoformat() if hasattr(value, "isoformat") else str(value)


def describe(
    alert: str,
    context: dict[str, Any] | None,
    interval_seconds: float | None = None,
    base_url: str | None = None,
) -> dict[str, Any]:
    """The alert message of a missed deadline, from the context the scheduler gives its
    callback (the run as the REST API shows it, and the deadline)."""
    run = (context or {}).get("dag_run") or {}
    deadline = (context or {}).get("deadline") or {}
    state = run.get("state")
    dag_id = run.get("dag_id")
    run_id = run.get("dag_run_id") or run.get("run_id")
    logical_date = run.get("logical_date")
    description = MISSED.get(alert, "the run missed its deadline ({span})").format(
        span=_span(interval_seconds), logical_date=logical_date
    )
    return {
        "deadline_alert": alert,
        **alerts.run_fields(alert, description, dag_id, run_id, state, base_url),
        "logical_date": logical_date,
        "deadline": _iso(deadline.get("deadline_time")),
        "note": (
            "the run failed: its data is stale all the same"
            if state == "failed"
            else "the run had not succeeded by its deadline"
        ),
    }


def own_budget_seconds(context: dict[str, Any] | None, settings: Any = None) -> float | None:
    """The run's own budget in seconds: the ``lock_ttl_minutes`` it ran with (the longest the
    run may hold the job, as the DAG's default TTL is for the default budget): its conf's, else
    the deployment's settings (the Variable ``pin_nightly_<dag_id>``, ``settings`` its raw
    value), as the run's options take them; None when the run keeps the default."""
    conf = (((context or {}).get("dag_run") or {}).get("conf")) or {}
    ttl = conf.get("lock_ttl_minutes", _setting(settings, "lock_ttl_minutes"))
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl <= 0:
        return None
    return float(ttl) * 60


def _setting(raw: Any, key: str) -> Any:
    """A key of a deployment's settings Variable (JSON; anything else: none)."""
    try:
        settings = json.loads(raw) if raw else {}
    except ValueError:
        return None
    return settings.get(key) if isinstance(settings, dict) else None


async def _settings(dag_id: str | None) -> Any:
    """The raw value of the deployment's settings Variable of ``dag_id`` (None: none)."""
    from airflow.sdk import Variable
    from asgiref.sync import sync_to_async

    return await sync_to_async(Variable.get)(f"pin_nightly_{dag_id}", default=None)


FINISHED = ("success", "failed")
POLL_SECONDS = 5.0


async def _run_state(dag_id: str, run_id: str) -> str:
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance
    from asgiref.sync import sync_to_async

    state = await sync_to_async(RuntimeTaskInstance.get_dagrun_state)(dag_id, run_id)
    return str(getattr(state, "value", state))  # a DagRunState, or its value


def _instant(value: Any) -> datetime | None:
    return None if value is None else datetime.fromisoformat(str(value))


async def _started(dag_id: str, run_id: str, poll: float) -> datetime | None:
    """When a run still queued (behind another: one run at a time) starts, to a poll; None
    when it ends without starting."""
    while (state := await _run_state(dag_id, run_id)) == "queued":
        await asyncio.sleep(poll)
    return None if state in FINISHED else datetime.now(UTC)


async def within_own_budget(
    context: dict[str, Any], interval_seconds: float | None, poll: float = POLL_SECONDS
) -> tuple[bool, float | None]:
    """For ``run_over_budget``: a run's budget counts from when it started running (a run
    queued behind another waits first, and is not over budget for that), and is the run's
    own when its conf gives a larger ``lock_ttl_minutes`` than the DAG's default. Wait (in
    the triggerer) until the run is over that budget, or until it finishes; return whether it
    finished within it, and the interval the alert reports."""
    if interval_seconds is None:
        return False, interval_seconds
    run = context["dag_run"]
    dag_id, run_id = run.get("dag_id"), run.get("dag_run_id") or run.get("run_id")
    own = max(own_budget_seconds(context, await _settings(dag_id)) or 0.0, interval_seconds)
    queued = _instant(run.get("queued_at") or run.get("run_after"))
    started = _instant(run.get("start_date")) if "start_date" in run else queued
    if started is None and (started := await _started(dag_id, run_id, poll)) is None:
        return True, own  # it ended (failed, say) before it ever ran: nothing over budget
    due = max(started, queued) + timedelta(seconds=own)
    if due <= queued + timedelta(seconds=interval_seconds):
        return False, interval_seconds
    log.info("run %s of %s: over its budget (%s) after %s", run_id, dag_id, _span(own), due)
    while (left := (due - datetime.now(UTC)).total_seconds()) > 0:
        state = await _run_state(dag_id, run_id)
        if state in FINISHED:
            log.info("run %s of %s ended (%s) within its own budget", run_id, dag_id, state)
            return True, own
        await asyncio.sleep(min(poll, left))
    run["state"] = await _run_state(dag_id, run_id)
    return run["state"] in FINISHED, own


async def deadline_missed(
    alert: str,
    context: dict[str, Any] | None = None,
    interval_seconds: float | None = None,
    **_: Any,
) -> None:
    """Deadline callback (runs in the triggerer): log at ERROR, notify, count. A run over the
    DAG's default budget but within a larger one of its own waits for that first."""
    from airflow.configuration import conf

    if alert == "run_over_budget" and context:
        ended, interval_seconds = await within_own_budget(context, interval_seconds)
        if ended:
            return
    info = describe(alert, context, interval_seconds, alerts.base_url(conf))
    log.error(
        "deadline missed (%(deadline_alert)s): dag=%(dag_id)s run=%(run_id)s "
        "state=%(run_state)s deadline=%(deadline)s; %(description)s; %(note)s; "
        "%(run_url)s",
        info,
    )
    await asyncio.to_thread(alerts.notify, "deadline_missed", info)
    metrics.incr(
        "pin_nightly_deadline_missed_total", tags={"dag_id": str(info["dag_id"]), "alert": alert}
    )
