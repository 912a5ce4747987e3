"""The read-only console: a page of the Airflow UI (``plugins/pin_nightly_plugin.py``
registers it) that shows each job's state as its database holds it.

Per job: the open sweeps and their ranges (share of the keyset done, rows a second, time left
at that rate), the last nights from the run log (work done, errors, duration against the
budget), the item errors still open with the conf of a targeted repair, the lease and the
pacing signals now against their limits. It reads through a session set read-only
(``default_transaction_read_only``), on the Airflow connection ``<conn_id>_readonly`` where one
is defined, else the job's own. The API server serves it; only the DAGs the auth manager lets
the user read are shown (docs/operations.md, "The console"). A request that changes state (a
control) is taken only with what a page of another site cannot send: a JSON body, the page's
CSRF token, and the console's own origin where the browser names one
(:func:`check_state_change`).
"""

# No ``from __future__ import annotations`` here: FastAPI reads the endpoints' annotations, and
# their types are imported inside create_app (the plugin loads in every Airflow process, see App).
import email.message
import functools
import hashlib
import hmac
import html
import json
import logging
import re
import secrets
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

from pin_nightly import controls, health, sweeps
from pin_nightly.db import (
    DatabaseUnavailable,
    JobConfigError,
    connect,
    connection,
    fetch_dicts,
    fetch_one_dict,
    first_line,
    from_database,
    resolve,
    sql,
    sqlstate,
    transaction,
)
from pin_nightly.jobs import Job, registered

log = logging.getLogger(__name__)

NIGHTS = 30  # days of run log the page plots
ERRORS_SHOWN = 200  # open item errors listed per job at most
STATEMENT_TIMEOUT = "10s"  # the console's statements are small; none may weigh on the server
READONLY_SUFFIX = "_readonly"
URL_PREFIX = "/pin-nightly"  # where the API server mounts the console's app
CSRF_HEADER = "X-CSRF-Token"  # the page's requests that change state carry its token here
CSRF_COOKIE = "pin_nightly_csrf"  # the browser session's nonce that the token is bound to
CSRF_NONCE = re.compile(r"[A-Za-z0-9_-]{43}")  # secrets.token_urlsafe(32)
JSON_TYPE = "application/json"
DEFAULT_PORTS = {"http": 80, "https": 443}

# The job-owned columns the console reads: a database without one of them has an older schema
# than this release (include/sql/schema/pin_nightly.sql brings it up to date).
EXPECTED_COLUMNS = {
    "job_lease": ("lock_key", "holder", "acquired_at", "expires_at", "run_deadline_at"),
    "sweep": ("sweep_id", "job", "scope", "family", "resumable", "status", "run_id", "owner")
    + ("started_at",),
    "sweep_range": ("sweep_id", "range_no", "lower_id", "upper_id", "planned_rows", "cursor_id")
    + ("status", "owner", "rows_processed", "rows_changed", "batches", "skipped_locked")
    + ("item_errors", "wrapped", "updated_at", "pauses", "paused_ms"),
    "sweep_control": ("sweep_id", "paused", "settings", "updated_by", "updated_at"),
    "item_error": ("job", "run_id", "sweep_id", "item_id", "sqlstate", "message", "item_kind")
    + ("recorded_at",),
    "run_log": ("job", "run_id", "status", "result", "started_at", "finished_at"),
}


class SchemaOutdated(RuntimeError):
    """The job database lacks a table or column the console reads."""


# ------------------------------------------------------------------------------- reading


def readonly_session(conn) -> None:
    """Make every transaction of the session read-only and bound its statements."""
    with transaction(conn) as cur:
        cur.execute(sql("console/session"), {"statement_timeout": STATEMENT_TIMEOUT})


def console_conn_id(conn_id: str) -> str:
    """``<conn_id>_readonly`` when that Airflow connection is defined, else ``conn_id``."""
    try:
        resolve(conn_id + READONLY_SUFFIX)
    except JobConfigError:
        return conn_id
    return conn_id + READONLY_SUFFIX


def check_schema(cur) -> None:
    """:class:`SchemaOutdated` naming what is missing, when the job-owned tables are older
    than the console (or not readable by its role)."""
    cur.execute(sql("console/schema_columns"))
    present: dict[str, set[str]] = {}
    for table, column in cur.fetchall():
        present.setdefault(table, set()).add(column)
    missing = []
    for table, columns in EXPECTED_COLUMNS.items():
        if table not in present:
            missing.append(f"table pin_nightly.{table}")
            continue
        missing += [f"column pin_nightly.{table}.{c}" for c in columns if c not in present[table]]
    if missing:
        raise SchemaOutdated(
            "the job database's schema is older than this console expects (or not readable by "
            f"its role): {', '.join(missing)} missing; a DBA applies "
            "include/sql/schema/pin_nightly.sql, then include/sql/schema/roles.sql"
        )


def read_job(job: Job, days: int = NIGHTS) -> dict[str, Any]:
    """The job's state as its database holds it; ``state`` is ``ok``, or ``unreachable``,
    ``schema`` or ``not_configured`` with a ``message`` saying why nothing else is there."""
    out: dict[str, Any] = {"dag_id": job.dag_id, "job": job.code, "state": "ok", "message": None}
    out.update(work_label=job.work_label, budget_minutes=job.budget_minutes)
    conn_id = out["conn_id"] = console_conn_id(job.conn_id)
    try:
        conn = connect(conn_id, prepare=readonly_session)
    except JobConfigError as exc:
        return {**out, "state": "not_configured", "message": str(exc)}
    except DatabaseUnavailable as exc:
        return {**out, "state": "unreachable", "message": f"job database unreachable: {exc}"}
    try:
        with transaction(conn) as cur:
            check_schema(cur)
            out.update(_read(cur, job, days))
        out.update(read_signals(conn, job))
    except SchemaOutdated as exc:
        return {**out, "state": "schema", "message": str(exc)}
    except Exception as exc:
        code = sqlstate(exc)
        if code in ("42P01", "42703"):  # undefined table / column
            return {**out, "state": "schema", "message": _schema_message(exc)}
        if code is None and not from_database(exc):
            raise
        log.warning("console: reading %s failed: %s", job.dag_id, exc)
        return {**out, "state": "unreachable", "message": f"reading the job database failed: {exc}"}
    finally:
        try:
            conn.close()
        except Exception:  # noqa: BLE001, S110 - already broken
            pass
    return out


def _schema_message(exc: BaseException) -> str:
    return (
        "the job database's schema is older than this console expects: "
        f"{first_line(exc)}; a DBA applies include/sql/schema/pin_nightly.sql"
    )


def _read(cur, job: Job, days: int) -> dict[str, Any]:
    params = {"job": job.code}
    cur.execute(sql("console/open_sweeps"), params)
    open_sweeps = [_progress(s) for s in fetch_dicts(cur)]
    cur.execute(sql("console/open_ranges"), params)
    ranges = fetch_dicts(cur)
    for s in open_sweeps:
        s["ranges"] = [
            {**r, "label": sweeps.range_label({**r, "prefix": s["family"]})}
            for r in ranges
            if r["sweep_id"] == s["sweep_id"]
        ]
    cur.execute(sql("console/nights"), {**params, "days": days})
    nights = [_night(job, n) for n in fetch_dicts(cur)]
    cur.execute(
        sql("console/open_item_errors"),
        {**params, "whole_family": job.whole_family, "limit": ERRORS_SHOWN},
    )
    errors = fetch_dicts(cur)
    cur.execute(sql("console/lease"), {"lock_key": job.lock_key})
    lease = fetch_one_dict(cur)
    return {
        "sweeps": open_sweeps,
        "nights": nights,
        "item_errors": errors,
        "repair": repair(job, [e["item_id"] for e in errors]),
        "lease": lease,
    }


def read_signals(conn, job: Job) -> dict[str, Any]:
    """The pacing signals now (``health/signals``), in a transaction of their own: a server
    that cannot answer them (a replica behind ``<conn_id>_readonly``) leaves the rest shown."""
    try:
        with transaction(conn) as cur:
            cur.execute(
                sql("health/signals"),
                {"tables": list(job.writes), "lock_key": "", "token": -1, "budget_share": 1.0},
            )
            row = fetch_one_dict(cur)
    except Exception as exc:
        if sqlstate(exc) is None and not from_database(exc):
            raise
        return {"signals": [], "can_read_stats": False, "signals_error": first_line(exc)}
    return {"signals": pacing(row), "can_read_stats": bool(row["can_read_stats"])}


def _progress(s: dict[str, Any]) -> dict[str, Any]:
    """A sweep row with its share done, rate and time left at that rate."""
    planned, done = s["planned_rows"], s["rows_done"]
    s["share_done"] = round(done / planned, 4) if planned else (1.0 if s["ranges_done"] else 0.0)
    seconds = None
    if s["last_batch_at"] is not None and s["working_since"] is not None:
        seconds = (s["last_batch_at"] - s["working_since"]).total_seconds()
    rate = s["rows_now"] / seconds if seconds and seconds > 0 and s["rows_now"] else None
    s["rows_per_second"] = round(rate, 1) if rate else None
    left = max(planned - done, 0)
    s["seconds_left"] = round(left / rate) if rate else (0 if left == 0 else None)
    return s


def _night(job: Job, n: dict[str, Any]) -> dict[str, Any]:
    result = n.pop("result") or {}
    if isinstance(result, str):
        result = json.loads(result)
    return {
        **n,
        "dry_run": bool(result.get("dry_run")),
        "scope": result.get("scope") or ("targeted" if result.get("targeted") else None),
        "work": job.work_done(result),
        "item_errors": int(result.get("item_errors") or 0),
        "duration_minutes": round(int(result.get("duration_ms") or 0) / 60000, 2),
    }


def repair(job: Job, ids: list[str]) -> dict[str, Any] | None:
    """What to trigger to repair ``ids``: the DAG's page and the conf of a targeted repair
    (the page's repair form sends it; Airflow 3.3's own trigger form takes no conf from a
    URL)."""
    if not ids:
        return None
    return {"dag_url": f"/dags/{job.dag_id}", "conf": {job.ids_param: sorted(set(ids))}}


def pacing(row: dict[str, Any]) -> list[dict[str, Any]]:
    """Each pacing signal now against its default limit, as ``health/signals`` reads it (a
    value of None says why in ``about``); the WAL rate and the lock waiters are measured by a
    running range only."""
    blind = "not readable: the console's role lacks pg_read_all_stats"
    stats = bool(row["can_read_stats"])
    lag = row["replica_lag_bytes"]
    no_replica = "no streaming replica" if stats else blind
    now = {
        "replica_lag_seconds": (
            row["replica_lag_seconds"],
            row["replica_lag_seconds_of"] if lag is not None else no_replica,
        ),
        "replica_lag_mb": (
            None if lag is None else round(lag / health.MB, 2),
            row["replica_lag_bytes_of"] if lag is not None else no_replica,
        ),
        "vacuum": (bool(row["vacuum"]), row["vacuum"] or (None if stats else blind)),
        "archive_backlog_segments": (
            row["archive_backlog"],
            None if row["archive_backlog"] is not None else "archive_mode off, or none archived",
        ),
    }
    return [_signal_now(lim, *now.get(lim.signal, (None, RANGE_ONLY))) for lim in health.LIMITS]


RANGE_ONLY = "measured by a running range only"


def _signal_now(lim: health.Limit, value, about) -> dict[str, Any]:
    limit = lim.default
    over = (
        bool(limit) and value is not None and (value if isinstance(value, bool) else value > limit)
    )
    row = {"signal": lim.signal, "param": lim.param, "limit": limit}
    return {**row, "value": value, "about": about, "over": bool(over)}


# ------------------------------------------------------------------------------- access


def _team(dag_id: str) -> str | None:
    from airflow.configuration import conf

    if not conf.getboolean("core", "multi_team", fallback=False):
        return None
    from airflow.models.dag import DagModel

    return DagModel.get_team_name(dag_id)


def authorized(user, dag_id: str, method: str = "GET") -> bool:
    """Whether the auth manager lets ``user`` read the DAG (``GET``), or edit it (``PUT``: give
    its sweeps controls)."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import DagDetails

    details = DagDetails(id=dag_id, team_name=_team(dag_id))
    return get_auth_manager().is_authorized_dag(method=method, details=details, user=user)


def give_control(user, dag_id: str, sweep_id: int, action: str, settings) -> controls.Control:
    """A control of the job's open sweep by ``user``, written on the job's own connection (not
    the console's read-only one); :class:`controls.ControlError` for an unknown DAG (404) or a
    user who may not edit it (403)."""
    job = {j.dag_id: j for j in registered()}.get(dag_id)
    if job is None:
        raise controls.ControlError(f"{dag_id} is not a pin-nightly DAG", 404)
    if not authorized(user, dag_id, "PUT"):
        raise controls.ControlError(f"Forbidden: you may not edit {dag_id}", 403)
    with connection(job.conn_id) as conn:
        return controls.give(conn, job, sweep_id, action, user.get_name(), settings)


# ------------------------------------------------------------------------------- cross-site


class Refused(Exception):
    """A state-changing request refused before anything is written (HTTP ``status``)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def _csrf_key() -> bytes:
    """The server secret the CSRF tokens are signed with: the API server's ``[api]
    secret_key``, the same in every API server process of a deployment."""
    from airflow.api_fastapi.auth.tokens import get_signing_key

    return get_signing_key("api", "secret_key").encode()


def csrf_token(user, nonce: str) -> str:
    """The page's CSRF token for ``user`` in the browser session whose :data:`CSRF_COOKIE` is
    ``nonce``: an HMAC of both with the server secret (OWASP's signed double-submit cookie).
    Another site's page can neither read it from the console's page nor compute it."""
    message = f"pin-nightly console csrf\0{user.get_id()}\0{nonce}".encode()
    return hmac.new(_csrf_key(), message, hashlib.sha256).hexdigest()


def csrf_nonce(cookies) -> str | None:
    """The browser session's nonce (:data:`CSRF_COOKIE`), None when it has none."""
    nonce = cookies.get(CSRF_COOKIE)
    return nonce if nonce and CSRF_NONCE.fullmatch(nonce) else None


def _origin(url: str) -> tuple[str, str, int] | None:
    """The scheme, host and port of ``url`` (an ``Origin`` or a ``Referer``); None for one
    that names none (``null``, a ``file:`` page)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname:
        return None
    return parts.scheme, parts.hostname, port or DEFAULT_PORTS[parts.scheme]


def foreign_origin(request) -> bool:
    """Whether the request's ``Origin`` (its ``Referer`` when it has none) is another site's:
    neither the request's own (its scheme and ``Host``) nor the UI's address (``[api]
    base_url``, as a proxy in front of the API server serves it). A request naming neither is
    left to the CSRF token."""
    from airflow.configuration import conf

    sent = request.headers.get("origin")
    if sent is None:
        sent = request.headers.get("referer")
        if sent is None:
            return False
    own = {_origin(str(request.url)), _origin(conf.get("api", "base_url", fallback="") or "")}
    return _origin(sent) not in own - {None}


def media_type(value: str | None) -> str:
    """The media type of a ``Content-Type`` header, parameters left out (``text/plain`` for
    none or one that does not parse, as RFC 2045 has it)."""
    message = email.message.Message()
    message["content-type"] = value or ""
    return message.get_content_type()


async def check_state_change(request, user) -> dict[str, Any]:
    """The JSON object a state-changing request of ``user`` carries, once it holds what a page
    of another site cannot send; :class:`Refused` otherwise, before anything is written: a
    foreign ``Origin`` or ``Referer`` (403), a body that is not ``application/json`` (415: a
    form, multipart or ``text/plain``, what a cross-site form or a no-cors fetch sends), a
    missing or wrong CSRF token (403), a body that is not a JSON object (422)."""
    if foreign_origin(request):
        raise Refused("Forbidden: the request comes from another site's page", 403)
    if media_type(request.headers.get("content-type")) != JSON_TYPE:
        raise Refused(f"Unsupported Media Type: the console takes {JSON_TYPE} only", 415)
    nonce, sent = csrf_nonce(request.cookies), request.headers.get(CSRF_HEADER, "")
    if nonce is None or not hmac.compare_digest(sent.encode(), csrf_token(user, nonce).encode()):
        raise Refused(
            f"Forbidden: the CSRF token ({CSRF_HEADER}) is missing or wrong; reload the page", 403
        )
    try:
        body = json.loads(await request.body())
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise Refused("the body is not a JSON object", 422)
    return body


def with_csrf_cookie(request, response, nonce: str):
    """``response`` setting the browser session's nonce, as the API server sets its own
    session cookie (HttpOnly, SameSite=Lax, Secure over HTTPS), for the console's path."""
    from airflow.configuration import conf

    secure = request.url.scheme == "https" or bool(conf.get("api", "ssl_cert", fallback=""))
    path = request.scope.get("root_path") or "/"
    response.set_cookie(CSRF_COOKIE, nonce, path=path, httponly=True, secure=secure, samesite="lax")
    return response


# ------------------------------------------------------------------------------- the page


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def _when(value: Any) -> str:
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return _e(value)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    return f"{h} h {rem // 60:02d} min" if h else f"{rem // 60} min {rem % 60:02d} s"


def _table(head: list[str], rows: list[list[str]], cls: str = "") -> str:
    th = "".join(f"<th>{h}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'


def figure_html(state: dict[str, Any]) -> str:
    """The last nights as plotly charts: work, errors, duration against the budget."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    nights = state["nights"]
    if not nights:
        return f"<p class='muted'>No run in the last {NIGHTS} days.</p>"
    x = [n["finished_at"] for n in nights]
    text = [f"{n['run_id']}<br>{n['status']}{' (dry run)' if n['dry_run'] else ''}" for n in nights]
    fig = make_subplots(
        rows=3,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.08,
        subplot_titles=(state["work_label"], "item errors", "duration (min) against the budget"),
    )
    traces = [
        go.Bar(name=state["work_label"], y=[n["work"] for n in nights]),
        go.Bar(name="item errors", y=[n["item_errors"] for n in nights], marker_color="#c0392b"),
        go.Scatter(
            name="duration", y=[n["duration_minutes"] for n in nights], mode="lines+markers"
        ),
    ]
    for row, trace in enumerate(traces, start=1):
        fig.add_trace(trace.update(x=x, hovertext=text), row=row, col=1)
    budget = go.Scatter(x=[x[0], x[-1]], y=[state["budget_minutes"]] * 2, name="budget")
    fig.add_trace(budget.update(mode="lines", line={"dash": "dash", "color": "#7f8c8d"}), 3, 1)
    fig.update_layout(height=620, margin={"l": 50, "r": 20, "t": 40, "b": 30}, showlegend=False)
    div_id = f"nights-{state['dag_id']}"
    return fig.to_html(
        full_html=False, include_plotlyjs=False, div_id=div_id, config={"displaylogo": False}
    )


def _signal_value(s: dict[str, Any]) -> str:
    if s["signal"] == "vacuum" and s["value"]:
        return f"running: {_e(s['about'])}"
    if s["signal"] == "vacuum" and not s["about"]:
        return "none"
    if s["value"] is None or s["signal"] == "vacuum":
        return f"<span class='muted'>{_e(s['about'])}</span>"
    about = f" ({_e(s['about'])})" if s["about"] else ""
    return f"{_e(s['value'])}{about}"


def _limit(s: dict[str, Any]) -> str:
    limit = s["limit"]
    shown = ("on" if limit else "off") if isinstance(limit, bool) else _e(limit)
    return f"{shown} <span class='muted'>({_e(s['param'])})</span>"


def _pauses(s: dict[str, Any]) -> str:
    if not s["pauses"]:
        return "no pause so far"
    by = ", ".join(f"{_e(k)} {v}" for k, v in sorted(s["pauses"].items()))
    return f"paused {_duration(s['paused_ms'] / 1000)} so far ({by})"


def _controls_html(state: dict[str, Any], s: dict[str, Any]) -> str:
    """The sweep's controls now and, for a user allowed to edit the DAG, the forms to give
    them (pin_nightly.controls: each range reads them before its next batch)."""
    now = "running"
    if s["paused"]:
        now = f"<b class='over'>paused</b> by {_e(s['control_by'])} at {_when(s['control_at'])}"
    if s["control_settings"]:
        given = ", ".join(f"{_e(k)}={_e(v)}" for k, v in sorted(s["control_settings"].items()))
        now += f"; settings given: {given} (by {_e(s['control_by'])})"
    out = f"<p class='control'>Control: {now}</p>"
    if not state.get("may_edit"):
        return out
    url = f"api/sweeps/{_e(state['dag_id'])}/{s['sweep_id']}"
    action = "resume" if s["paused"] else "pause"
    options = "".join(f"<option>{_e(k)}</option>" for k in controls.SETTINGS)
    return out + (
        f"<form class='control' data-url='{url}'><button name='action' value='{action}'>"
        f"{action.capitalize()} sweep</button> <select name='setting'>{options}</select> "
        "<input name='value' size='8' placeholder='value'> <button name='action' "
        "value='settings'>Set</button> <span class='result'></span></form>"
    )


def job_html(state: dict[str, Any]) -> str:
    dag_id = state["dag_id"]
    head = (
        f"<section class='job' id='{_e(dag_id)}'><h2><a href='/dags/{_e(dag_id)}'>"
        f"{_e(dag_id)}</a></h2><p class='muted'>connection "
        f"<code>{_e(state['conn_id'])}</code>, read-only session</p>"
    )
    if state["state"] != "ok":
        return head + f"<div class='alert {state['state']}'>{_e(state['message'])}</div></section>"
    parts = [head, _lease_html(state["lease"]), _signals_html(state)]
    parts.append(f"<h3>Open sweeps ({len(state['sweeps'])})</h3>")
    if not state["sweeps"]:
        parts.append("<p class='muted'>None: every sweep is done.</p>")
    parts += [_sweep_html(state, s) for s in state["sweeps"]]
    parts.append(f"<h3>Last {NIGHTS} nights</h3>" + figure_html(state))
    parts.append(_errors_html(state))
    return "".join(parts) + "</section>"


def _lease_html(lease: dict[str, Any] | None) -> str:
    if not lease:
        return "<p><b>Lease</b> free: no run holds it</p>"
    live = "held" if lease["live"] else "expired"
    return (
        f"<p><b>Lease</b> {live} by <code>{_e(lease['holder'])}</code> since "
        f"{_when(lease['acquired_at'])}, expires {_when(lease['expires_at'])}, run deadline "
        f"{_when(lease['run_deadline_at'])}</p>"
    )


def _signals_html(state: dict[str, Any]) -> str:
    rows = [
        [f"<code>{_e(s['signal'])}</code>", _signal_value(s), _limit(s)]
        + ["<b class='over'>over</b>" if s["over"] else "ok"]
        for s in state["signals"]
    ]
    out = "<h3>Pacing signals now</h3>" + _table(["signal", "now", "limit", ""], rows)
    if state.get("signals_error"):
        out += f"<p class='muted'>Not readable here: {_e(state['signals_error'])}</p>"
    return out + (
        "<p class='muted'>Limits are the DAG params' defaults; a run given others paces on "
        "those.</p>"
    )


def _sweep_html(state: dict[str, Any], s: dict[str, Any]) -> str:
    rate = f"{s['rows_per_second']:.1f}" if s["rows_per_second"] else "no batch yet"
    rows = [
        [_e(r["label"]), _e(r["status"]), f"{r['rows_processed']} / {r['planned_rows']}"]
        + [_e(r["rows_changed"]), _e(r["batches"]), f"<code>{_e(r['cursor_id'] or 'start')}</code>"]
        + [_when(r["updated_at"])]
        for r in s["ranges"]
    ]
    head = ["range", "state", "rows checked / planned", "changed", "batches", "cursor", "updated"]
    return (
        f"<div class='sweep'><p><b>{_e(s['scope'])}</b> (sweep {s['sweep_id']}, "
        f"{'resumable' if s['resumable'] else 'not resumable'}) started "
        f"{_when(s['started_at'])}, owner <code>{_e(s['owner'])}</code><br>"
        f"<b>{s['share_done'] * 100:.1f} %</b> of {s['planned_rows']} planned rows done; "
        f"ranges {s['ranges_done']}/{s['ranges_total']} done; {rate} rows/s; time left at that "
        f"rate: {_duration(s['seconds_left'])}; item errors {s['item_errors']}, skipped "
        f"locked {s['skipped_locked']}; {_pauses(s)}</p>"
        + _controls_html(state, s)
        + _table(head, rows, "ranges")
        + "</div>"
    )


def _errors_html(state: dict[str, Any]) -> str:
    errors = state["item_errors"]
    out = f"<h3>Item errors still open ({len(errors)})</h3>"
    if not errors:
        return out + "<p class='muted'>None.</p>"
    fix = state["repair"]
    rows = [
        [f"<code>{_e(e['item_id'])}</code> {_e(e['item_kind'])}"]
        + [f"<code>{_e(e['sqlstate'])}</code> {_e(e['message'])}"]
        + [_when(e["recorded_at"]), _e(e["run_id"])]
        for e in errors
    ]
    conf = _e(json.dumps(fix["conf"], indent=1))
    out += _table(["row", "error", "recorded", "run"], rows, "errors")
    if not state.get("may_edit"):
        return out + (
            f"<p class='repair'>A targeted repair of these rows: trigger "
            f"<a href='{_e(fix['dag_url'])}'>{_e(state['dag_id'])}</a> with</p>"
            f"<pre class='conf'>{conf}</pre>"
        )
    return out + (
        f"<form class='repair' data-dag='{_e(state['dag_id'])}'><p>A targeted repair of these "
        "rows: the run's conf, as the DAG's trigger form would send it</p>"
        f"<textarea name='conf' class='conf' rows='6' cols='70'>{conf}</textarea><br>"
        "<button>Trigger the repair</button> <span class='result'></span></form>"
    )


STYLE = """
body{font-family:system-ui,sans-serif;margin:1rem 1.5rem;color:#222}
h1{font-size:1.4rem}h2{font-size:1.2rem;margin-top:2rem}h3{font-size:1rem;margin-bottom:.3rem}
table{border-collapse:collapse;font-size:.85rem;margin:.3rem 0}
td,th{border:1px solid #ddd;padding:.2rem .45rem;text-align:left;vertical-align:top}
th{background:#f4f4f4}.muted{color:#777}.over{color:#c0392b}
.alert{padding:.6rem .8rem;border:1px solid #c0392b;background:#fdecea;border-radius:4px}
.sweep{margin:.5rem 0 1rem}pre.conf{background:#f4f4f4;padding:.5rem;max-width:60rem}
section.job{border-top:2px solid #ddd}
"""


# The control forms post JSON with the page's CSRF token (a cross-site form can send neither)
# and reload the page with the answer.
CONTROL_JS = """
var csrf = document.querySelector('meta[name=csrf-token]').content;
document.querySelectorAll('form.control').forEach(function (form) {
  form.addEventListener('submit', function (ev) {
    ev.preventDefault();
    var action = ev.submitter.value, body = {};
    if (action === 'settings') {
      var v = form.value.value.trim(), n = Number(v);
      body.settings = {};
      body.settings[form.setting.value] = v === 'true' ? true : v === 'false' ? false : n;
    }
    fetch(form.dataset.url + '/' + action, {method: 'POST', credentials: 'same-origin',
      headers: {'Content-Type': 'application/json', 'X-CSRF-Token': csrf},
      body: JSON.stringify(body)})
      .then(function (r) { return r.json().then(function (j) { return [r.ok, j]; }); })
      .then(function (a) {
        form.querySelector('.result').textContent = a[0] ? 'done' : a[1].detail;
        if (a[0]) { location.reload(); }
      });
  });
});
"""


# The repair form triggers a run of the DAG through Airflow's REST API, as the user.
REPAIR_JS = """
document.querySelectorAll('form.repair').forEach(function (form) {
  form.addEventListener('submit', function (ev) {
    ev.preventDefault();
    var out = form.querySelector('.result'), conf;
    try { conf = JSON.parse(form.conf.value); } catch (e) { out.textContent = e; return; }
    fetch('/api/v2/dags/' + form.dataset.dag + '/dagRuns', {method: 'POST',
      credentials: 'same-origin', headers: {'Content-Type': 'application/json'},
      body: JSON.stringify({logical_date: null, conf: conf})})
      .then(function (r) { return r.json().then(function (j) { return [r.ok, j]; }); })
      .then(function (a) {
        out.textContent = a[0] ? 'triggered: ' + a[1].dag_run_id : JSON.stringify(a[1].detail);
      });
  });
});
"""


def page_html(states: list[dict[str, Any]], csrf: str) -> str:
    """The page; ``csrf`` is its CSRF token (:func:`csrf_token`), which its controls send."""
    sections = "".join(job_html(s) for s in states)
    at = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>pin-nightly</title>"
        f"<meta name='csrf-token' content='{_e(csrf)}'>"
        f"<style>{STYLE}</style><script src='static/plotly.min.js'></script></head><body>"
        f"<h1>pin-nightly</h1><p class='muted'>Read at {at}, read-only. Reload to refresh.</p>"
        f"{sections}<script>{CONTROL_JS}{REPAIR_JS}</script></body></html>"
    )


# ------------------------------------------------------------------------------- the app


@functools.cache
def plotly_js() -> bytes:
    """plotly.js as the pinned plotly package ships it (served by the app: no CDN)."""
    from plotly.offline import get_plotlyjs

    return get_plotlyjs().encode()


class App:
    """The console as the API server mounts it at :data:`URL_PREFIX`: an ASGI app that builds
    the FastAPI app (:func:`create_app`) at its first request. Every Airflow process loads the
    plugin, a task's too (for its listeners): none of them imports FastAPI and the core API for
    a console it never serves."""

    def __init__(self) -> None:
        self._app = None

    async def __call__(self, scope, receive, send) -> None:
        if self._app is None:
            self._app = create_app()
        await self._app(scope, receive, send)


def create_app():
    """The console's FastAPI app: the page, its JSON, plotly.js, and the controls."""
    from fastapi import FastAPI

    app = FastAPI(title="pin-nightly console", docs_url=None, redoc_url=None, openapi_url=None)
    _add_pages(app)
    _add_controls(app)
    return app


def _states(user) -> list[dict[str, Any]]:
    from fastapi import HTTPException

    allowed = [j for j in registered() if authorized(user, j.dag_id)]
    if not allowed:
        raise HTTPException(403, "Forbidden: you may read neither pin-nightly DAG")
    return [{**read_job(j), "may_edit": authorized(user, j.dag_id, "PUT")} for j in allowed]


def _add_pages(app) -> None:
    from airflow.api_fastapi.core_api.security import GetUserDep
    from fastapi import Request
    from fastapi.encoders import jsonable_encoder
    from fastapi.responses import HTMLResponse, JSONResponse, Response

    @app.get("/api/jobs")
    def api_jobs(user: GetUserDep) -> JSONResponse:
        return JSONResponse(jsonable_encoder({"jobs": _states(user)}))

    @app.get("/", response_class=HTMLResponse)
    def page(request: Request, user: GetUserDep) -> HTMLResponse:
        nonce = csrf_nonce(request.cookies)
        if nonce is not None:
            return HTMLResponse(page_html(_states(user), csrf_token(user, nonce)))
        nonce = secrets.token_urlsafe(32)
        page = HTMLResponse(page_html(_states(user), csrf_token(user, nonce)))
        return with_csrf_cookie(request, page, nonce)

    @app.get("/static/plotly.min.js")
    def plotly() -> Response:
        headers = {"Cache-Control": "public, max-age=86400"}
        return Response(plotly_js(), media_type="application/javascript", headers=headers)


def _add_controls(app) -> None:
    """The controls: every request that changes state depends on ``state_change``
    (:func:`check_state_change`), so that none is taken without its checks."""
    from typing import Annotated

    from airflow.api_fastapi.core_api.security import GetUserDep
    from fastapi import Depends, HTTPException, Request
    from fastapi.encoders import jsonable_encoder
    from fastapi.responses import JSONResponse

    async def state_change(request: Request, user: GetUserDep) -> dict[str, Any]:
        try:
            return await check_state_change(request, user)
        except Refused as exc:
            raise HTTPException(exc.status, str(exc)) from None

    @app.post("/api/sweeps/{dag_id}/{sweep_id}/{action}")
    def control(
        dag_id: str,
        sweep_id: int,
        action: str,
        user: GetUserDep,
        body: Annotated[dict[str, Any], Depends(state_change)],
    ) -> JSONResponse:
        try:
            settings = body.get("settings")
            given = give_control(user, dag_id, sweep_id, action, settings)
        except controls.ControlError as exc:
            raise HTTPException(exc.status, str(exc)) from None
        return JSONResponse(jsonable_encoder({"sweep_id": sweep_id, "control": given.__dict__}))
