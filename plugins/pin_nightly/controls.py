"""Controls over a running sweep, given from the console by a user allowed to edit the DAG:
pause and resume it, change its batch size or its pacing limits. A control is a row of
``pin_nightly.sweep_control`` that each of the sweep's ranges reads before each batch (so it
takes effect within a batch, without a restart, and survives a worker's death); every control
given is an event in ``pin_nightly.control_event``, which the summary of a run that worked the
sweep lists. docs/operations.md, "The console".
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from pin_nightly import health as healths
from pin_nightly.db import fetch_dicts, fetch_one_dict, sql, transaction

log = logging.getLogger(__name__)

ACTIONS = ("pause", "resume", "settings")
# the params a control may set mid-run (each within its param's bounds)
SETTINGS = ("batch_size", *(lim.param for lim in healths.LIMITS))
POLL_S = 2.0  # a paused range rechecks its control this often (outside any transaction)


class ControlError(ValueError):
    """A control refused: why, for the user (HTTP ``status``)."""

    def __init__(self, message: str, status: int = 422):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Control:
    """What an operator set on a sweep (the defaults: nothing)."""

    paused: bool = False
    settings: dict[str, Any] = field(default_factory=dict)
    updated_by: str | None = None
    updated_at: Any = None

    def limits(self, limits: dict[str, float]) -> dict[str, float]:
        """The pacing limits with the ones set here in place of the run's (0 or false: off)."""
        out = dict(limits)
        for lim in healths.LIMITS:
            if lim.param in self.settings:
                value = self.settings[lim.param]
                out.pop(lim.signal, None)
                if value:
                    out[lim.signal] = float(value)
        return out


def read(cur, sweep_id: int) -> Control:
    cur.execute(sql("common/control_read"), {"sweep_id": sweep_id})
    row = fetch_one_dict(cur)
    return Control(**row) if row else Control()


def give(conn, job, sweep_id: int, action: str, by: str, settings=None) -> Control:
    """Give the control ``action`` to the job's open sweep ``sweep_id`` as user ``by``; the
    control now. :class:`ControlError` (nothing written) for another job's sweep, one that is
    not open, an unknown action, or a setting that is not one or is out of its param's bounds."""
    settings = dict(settings or {})
    if action not in ACTIONS:
        raise ControlError(f"unknown control {action!r} (one of: {', '.join(ACTIONS)})")
    if action == "settings":
        check_settings(job, settings)
    elif settings:
        raise ControlError(f"{action} takes no settings")
    with transaction(conn) as cur:
        cur.execute(sql("common/control_sweep"), {"sweep_id": sweep_id})
        sweep = fetch_one_dict(cur)
        if sweep is None or sweep["job"] != job.code:
            raise ControlError(f"no sweep {sweep_id} of {job.dag_id}", 404)
        if sweep["status"] != "open":
            raise ControlError(
                f"sweep {sweep_id} ({sweep['scope']}) is {sweep['status']}, not open: "
                "only an open sweep takes controls",
                409,
            )
        paused = {"pause": True, "resume": False}.get(action)
        params = {"sweep_id": sweep_id, "by": by, "settings": json.dumps(settings)}
        cur.execute(sql("common/control_set"), {**params, "paused": paused})
        now = Control(**fetch_one_dict(cur))
        cur.execute(sql("common/control_event"), {**params, "action": action})
    log.info("sweep %s: %s %s by %s", sweep_id, action, settings or "", by)
    return now


def check_settings(job, settings: dict[str, Any]) -> None:
    from pin_nightly.jobs import setting_error

    if not settings:
        raise ControlError(f"no setting given (one of: {', '.join(SETTINGS)})")
    spec = job.params
    errors = [
        f"{k!r} is not a setting a running sweep takes (one of: {', '.join(SETTINGS)})"
        if k not in SETTINGS
        else setting_error(spec, k, v)
        for k, v in settings.items()
    ]
    if errors := [e for e in errors if e]:
        raise ControlError("; ".join(errors))


def events_of_run(conn, run_id: str, since) -> list[dict[str, Any]]:
    """The controls given to the sweeps a run worked since ``since`` (for its summary)."""
    with transaction(conn) as cur:
        cur.execute(sql("common/control_events_of_run"), {"run_id": run_id, "since": since})
        return fetch_dicts(cur)
