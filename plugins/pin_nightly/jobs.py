"""What both jobs share around the keyset machinery: run identity, lease tasks, the run log."""

from __future__ import annotations

import functools
import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, date, datetime, timedelta
from typing import Any

from pin_nightly import keyset, metrics, tracing
from pin_nightly import lease as leases
from pin_nightly.db import (
    JobConfigError,
    check_columns,
    connection,
    ensure_schema,
    fetch_one_dict,
    has_index_on,
    resolve,
    sql,
    transaction,
)
from pin_nightly.health import REPLICAS_PARAM

log = logging.getLogger(__name__)

LOCK_HELD = "skipped, lock held"
# JSON-schema pattern of a uuid param item (hyphens optional, any case); parse_uuids normalizes.
UUID_PATTERN = "^[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}$"


@dataclass(frozen=True)
class JobDef:
    code: str  # the job code of the spec, e.g. news-comment-reconcile
    dag_id: str
    conn_id: str
    lock_key: str
    domain_columns: dict[str, list[str]]
    # (relation that proves the DDL was applied, include/sql file with the DDL)
    owned_ddl: list[tuple[str, str]]
    # (table, fragment of the index definition, human name) of recommended indexes
    recommended_indexes: list[tuple[str, str, str]] = field(default_factory=list)
    # (retention param in days, statement that prunes past it) of the job-owned history
    history: tuple[tuple[str, str], ...] = (
        ("run_log_retention_days", "common/prune_run_log"),
        ("run_log_retention_days", "common/prune_signals"),
        ("sweep_retention_days", "common/prune_sweeps"),
        ("item_error_retention_days", "common/prune_item_errors"),
    )


# Upper bounds of the run budget and the lease TTL: larger values overflow PostgreSQL's
# timestamps half-way through a run instead of being refused when the run is created.
MAX_RUN_MINUTES = 7 * 24 * 60
MAX_TTL_MINUTES = 14 * 24 * 60
MAX_BATCH = 100_000
MAX_RETENTION_DAYS = 3660
HISTORY_DAYS = 90  # the runbook reads three months back


def retention_param(what: str):
    from airflow.sdk import Param

    return Param(
        HISTORY_DAYS,
        type="integer",
        minimum=1,
        maximum=MAX_RETENTION_DAYS,
        description=f"Days that {what} are kept; older ones are deleted by the runs (an "
        f"integer from 1 to {MAX_RETENTION_DAYS})",
    )


def common_params(
    run_minutes: float,
    ttl_minutes: float,
    ids: str,
    ids_description: str,
    dry_run_description: str,
    ranges_per: str = "",
) -> dict[str, Any]:
    """The params both jobs have: time budget, lease TTL, targeted ids, dry run, ranges."""
    from airflow.sdk import Param

    return {
        "max_run_duration_minutes": Param(
            run_minutes,
            type="number",
            exclusiveMinimum=0,
            maximum=MAX_RUN_MINUTES,
            description="Time budget: no batch starts later than this after the lease is "
            f"taken; minutes, more than 0 and at most {MAX_RUN_MINUTES}",
        ),
        "lock_ttl_minutes": Param(
            ttl_minutes,
            type="number",
            exclusiveMinimum=0,
            maximum=MAX_TTL_MINUTES,
            description="Lease TTL in minutes; must exceed max_run_duration_minutes",
        ),
        ids: Param(
            [],
            type="array",
            items={"type": "string", "pattern": UUID_PATTERN},
            description=ids_description,
        ),
        "dry_run": Param(False, type="boolean", description=dry_run_description),
        "max_ranges": Param(
            8,
            type="integer",
            minimum=1,
            maximum=64,
            description=f"Upper bound of keyset ranges (mapped tasks){ranges_per}, an integer "
            "from 1 to 64",
        ),
        "run_log_retention_days": retention_param("run results (pin_nightly.run_log)"),
        "sweep_retention_days": retention_param(
            "closed sweeps and their range cursors (pin_nightly.sweep, sweep_range)"
        ),
        "item_error_retention_days": retention_param(
            "rows a batch could not write (pin_nightly.item_error)"
        ),
        **pace_params(),
    }


def pace_params() -> dict[str, Any]:
    """The limits of pacing on the database's health (README, "Pacing on the database's
    health"); defaults in :data:`health.PARAMS`. A number of 0 turns its signal off."""
    from airflow.sdk import Param

    from pin_nightly.health import PARAMS as PACE

    off = "; 0 turns it off"

    def number(param: str, what: str, integer: bool = False) -> Param:
        return Param(
            PACE[param][1],
            type="integer" if integer else "number",
            minimum=0,
            description=f"Pause batches while {what}{off}",
        )

    return {
        "pace_max_replica_lag_seconds": number(
            "pace_max_replica_lag_seconds",
            "a streaming replica's replay lag (pg_stat_replication) is over this many seconds",
        ),
        "pace_max_replica_lag_mb": number(
            "pace_max_replica_lag_mb",
            "a streaming replica has more than this many MB of WAL not replayed yet",
        ),
        "pace_on_vacuum": Param(
            PACE["pace_on_vacuum"][1],
            type="boolean",
            description="Pause batches while a VACUUM (autovacuum or manual) runs on a table "
            "they write",
        ),
        "pace_max_wal_mb_per_second": number(
            "pace_max_wal_mb_per_second",
            "the server writes more than this many MB of WAL per second (over the last ~10 s "
            "of the range's work)",
        ),
        "pace_max_archive_backlog_segments": number(
            "pace_max_archive_backlog_segments",
            "more than this many WAL segments wait for the archiver (when archive_mode is on)",
            integer=True,
        ),
        REPLICAS_PARAM: Param(
            [],
            type="array",
            items={"type": "string", "minLength": 1},
            description="Airflow connections of the replicas whose replay lag paces the job "
            "(read on each replica); empty: every streaming replica in pg_stat_replication",
        ),
        "pace_max_lock_waiters": number(
            "pace_max_lock_waiters",
            "more than this many sessions were waiting for the job's row locks at the end of "
            "the last batch",
            integer=True,
        ),
    }


def defaults(params: dict[str, Any]) -> dict[str, Any]:
    return {name: param.value for name, param in params.items()}


def check_budget(p: dict[str, Any], errors: list[str]) -> None:
    """The rule across the budget params: the lease must outlive the run."""
    if p["lock_ttl_minutes"] <= p["max_run_duration_minutes"]:
        errors.append(
            f"lock_ttl_minutes ({p['lock_ttl_minutes']}) must exceed max_run_duration_minutes "
            f"({p['max_run_duration_minutes']}): the lock must outlive the run"
        )


def run_tag() -> str:
    """A random tag that validate_options draws once per run (and again when the whole run is
    cleared). With the dag id and run id it names the run's acquisition of the lease, which
    owns the sweeps and ranges it works: two deployments that fire one cron slot give their
    runs the same id (``scheduled__<slot>``), never the same tag. Clearing some tasks of a run
    (a range re-runs with its setup task, acquire_lease) keeps the tag, and with it the work."""
    return uuid.uuid4().hex[:12]


def holder_of(job: JobDef, opts: dict[str, Any], run_id: str) -> str:
    """The lease holder, and owner of the sweeps, of the run's acquisition."""
    tag = opts.get("run_tag")
    return f"{job.dag_id}/{run_id}" + (f" ~{tag}" if tag else "")


def run_instant(logical_date: datetime | None, run_after: datetime | None) -> datetime:
    """The instant a run is about: its logical date, or when it was due to run (a manual run
    triggered without a logical date)."""
    return logical_date or run_after or datetime.now(UTC)


def preflight(conn, job: JobDef) -> list[str]:
    """Check the domain tables, create the job-owned tables if absent; return warnings."""
    for table, columns in job.domain_columns.items():
        check_columns(conn, table, columns)
    for probe, ddl in job.owned_ddl:
        ensure_schema(conn, probe, ddl)
    warnings = []
    for table, fragment, name in job.recommended_indexes:
        if not has_index_on(conn, table, fragment):
            msg = (
                f"recommended index {name} on {table} is missing: the job stays correct "
                "but slower (include/sql/schema/ has the migration)"
            )
            log.warning(msg)
            warnings.append(msg)
    return warnings


def acquire_lease(job: JobDef, opts: dict[str, Any], run_id: str) -> dict[str, Any]:
    """The setup task: preflight checks, then take the lease for the run ``run_id``.

    When another holder has it, the run's work is skipped: the result says
    ``acquired: False`` and the planning task plans nothing (the run succeeds, doing nothing).
    """
    holder = holder_of(job, opts, run_id)
    for replica in opts.get(REPLICAS_PARAM) or ():
        resolve(replica)  # a named replica's connection must exist before anything is written
    with connection(job.conn_id) as conn:
        warnings = preflight(conn, job)
        try:
            got = leases.acquire(
                conn,
                job.lock_key,
                holder,
                opts["lock_ttl_minutes"],
                opts["max_run_duration_minutes"],
            )
        except BaseException:
            # the lease may be written and this task still fail (the connection lost after the
            # commit): the run's teardown does not run when its setup failed, so free it here
            leases.release_holder(conn, job.lock_key, holder)
            raise
    if isinstance(got, leases.LeaseHeld):
        log.warning(
            "%s: %s (key=%s holder=%s expires_at=%s)",
            job.code,
            LOCK_HELD,
            job.lock_key,
            got.holder,
            got.expires_at,
        )
        return {"acquired": False, "holder": got.holder, "expires_at": got.expires_at}
    log.info(
        "lease %s acquired by %s (token %s); run deadline %s",
        job.lock_key,
        holder,
        got.token,
        got.run_deadline_at,
    )
    trace = tracing.new_run(run_attributes(job, opts, run_id, holder))
    return {**got.to_xcom(), "acquired": True, "warnings": warnings, "trace": trace}


def run_attributes(job: JobDef, opts: dict[str, Any], run_id: str, holder: str) -> dict[str, Any]:
    """The attributes of a run's ``job_run`` span (the spec's names, then ``pin.*``)."""
    scope = opts.get("effective_scope") or ("Targeted" if opts.get("card_ids") else "AllCards")
    attributes = {
        "jobRunId": run_id,
        "correlationId": run_id,
        "scope": scope,
        "batchSize": opts["batch_size"],
        "pin.job": job.dag_id,
        "pin.holder": holder,
        "pin.dry_run": opts["dry_run"],
    }
    if "as_of_date" in opts:
        attributes["pin.as_of_date"] = opts["as_of_date"]
    return attributes


def lease_from_xcom(data: dict[str, Any] | None) -> leases.Lease | None:
    """The lease this run holds, or None when it did not get it."""
    if not data or not data.get("acquired"):
        return None
    return leases.Lease.from_xcom(data)


def release_lease(job: JobDef, lease_data: dict[str, Any] | None) -> bool:
    """Release the lease if this run holds it: the teardown task, and the summary (the
    teardown does not run again when only a run's failed tasks are cleared)."""
    lease = _held(lease_data)
    if lease is None:
        return False
    with connection(job.conn_id) as conn:
        return leases.release(conn, lease)


def _held(lease_data: dict[str, Any] | None) -> leases.Lease | None:
    """The lease the run holds; None, said in the log, when it took none."""
    lease = lease_from_xcom(lease_data)
    if lease is None:
        log.info("no lease was taken by this run: nothing to release")
    return lease


def teardown(
    job: JobDef, lease_data: dict[str, Any] | None, emit_state: Callable[[Any], None]
) -> bool:
    """The teardown task: release the lease, then send the job's state gauges (``emit_state``
    on the same connection: the teardown runs when the summary failed, and the work a run
    completed is then still seen) and the run's ``job_run`` span, from the acquisition to now."""
    lease = _held(lease_data)
    if lease is None:
        return False
    with connection(job.conn_id) as conn:
        released = leases.release(conn, lease)
        emit_state(conn)
    tracing.end_run(lease_data.get("trace"), datetime.fromisoformat(lease.acquired_at))
    return released


def prune_history(conn, job: JobDef, opts: dict[str, Any]) -> dict[str, int]:
    """Delete the job-owned history past its retention params (not in a dry run); return the
    rows deleted per param."""
    if opts["dry_run"]:
        return {}
    pruned = {}
    with transaction(conn) as cur:
        for param, statement in job.history:
            cur.execute(sql(statement), {"job": job.code, "days": opts[param]})
            pruned[param] = pruned.get(param, 0) + cur.rowcount
    if any(pruned.values()):
        log.info("job history past its retention deleted: %s", pruned)
    return pruned


def resumed(totals: list[dict[str, Any]], lease: leases.Lease) -> bool:
    """Whether the acquisition worked a sweep opened before it began (it resumed earlier
    work), from :func:`keyset.run_totals`."""
    began = datetime.fromisoformat(lease.acquired_at)
    return any(t["started_at"] < began for t in totals)


def is_nightly(run_type: Any) -> bool:
    """Whether a run of this type is the nightly work: a scheduled run (not one triggered by
    hand, a backfill or an asset). Only nightly runs set the gauges that describe the nightly
    work (a targeted repair of 3 posts must not clear a drift alert)."""
    return str(getattr(run_type, "value", run_type)) == "scheduled"


def is_backfill(run_type: Any) -> bool:
    """Whether a run was created by an Airflow backfill (the trigger form's Backfill tab,
    ``POST /api/v2/backfills``, ``airflow backfill create``)."""
    return str(getattr(run_type, "value", run_type)) == "backfill"


def check_backfill(job: JobDef, day: str, backfill: bool, snapshots: bool) -> None:
    """Refuse, before anything is written, a backfill run of a ``day`` (ISO) before yesterday
    (the database's clock, UTC): it would read tonight's data as that day's. The popularity job
    (``snapshots``) stamps today's counters as the day's snapshots, so the growth of every day
    since lands on that one, aged; tonight's run carries the growth instead. A backfill of a
    day already stored (a re-run), or older than stored snapshots (it writes nothing), goes on.
    News sweeps today's rows whatever the day: a backfill repeats one run's work per day."""
    if not backfill:
        return
    with connection(job.conn_id) as conn, transaction(conn) as cur:
        statement = "common/backfill_snapshots" if snapshots else "common/backfill_today"
        cur.execute(sql(statement), {"day": day})
        today, stored = cur.fetchone()
    if date.fromisoformat(day) >= today - timedelta(days=1) or stored:
        return
    carried = (
        "tonight's run carries the growth since the newest snapshot"
        if snapshots
        else "the next run's DailyWindow reaches back to the last completed sweep"
    )
    raise JobConfigError(
        f"backfill refused: {day} is before yesterday ({today - timedelta(days=1)}, the "
        f"database's clock in UTC), and a run reads today's data, not that day's: {carried}; "
        "nothing was written"
    )


@dataclass
class Signals:
    """What a summary sends: metrics declared in :data:`metrics.METRICS` (``[name, value,
    tags]``) and an alert (``None``: no alert). Gauges describe a state and are sent again by a
    summary run again; counters, timings and the alert are sent once per acquisition."""

    counters: list = field(default_factory=list)
    timings: list = field(default_factory=list)
    gauges: list = field(default_factory=list)
    alert: dict[str, Any] | None = None

    def send(self, first: bool, alert: Callable[[dict[str, Any]], None] | None = None) -> None:
        for name, value, tags in self.gauges:
            metrics.gauge(name, value, tags=tags)
        if not first:
            log.info("this run's summary was sent before: counters and alerts not sent again")
            return
        for name, value, tags in self.counters:
            metrics.incr(name, value, tags=tags)
        for name, value, tags in self.timings:
            metrics.timing(name, value, tags=tags)
        if self.alert is not None and alert is not None:
            alert(self.alert)


@dataclass(frozen=True)
class SignalWindow:
    """What a summary counts (see ``common/signal_window``)."""

    since_any: datetime
    since_nightly: datetime
    through: datetime
    work_done_at: datetime
    current: bool
    acquired_at: str  # the acquisition's start


def summary_signals(
    conn,
    job: JobDef,
    lease: leases.Lease,
    opts: dict[str, Any],
    run_id: str,
    build: Callable[[Any, SignalWindow, bool], Signals],
) -> tuple[Signals, bool]:
    """The signals of the acquisition's summary and whether this is its first summary: built
    once by ``build(cur, window, nightly)`` and stored in ``pin_nightly.run_signal``; a summary
    run again gets the stored ones. The summary of a run older than one that already sent its
    summary (a task cleared after newer nights) counts no window and is no nightly's."""
    run_at = opts.get("run_instant") or lease.acquired_at  # options of an older release
    key = {"job": job.code, "owner": lease.holder, "run_at": run_at}
    with transaction(conn) as cur:
        cur.execute(sql("common/signal_sent"), key)
        row = cur.fetchone()
        if row is not None:
            return Signals(**row[0]), False
        cur.execute(sql("common/signal_window"), {**key, "acquired_at": lease.acquired_at})
        window = SignalWindow(**fetch_one_dict(cur), acquired_at=lease.acquired_at)
        nightly = opts.get("nightly", False) and window.current
        if not window.current:
            log.warning("a newer run sent its summary: this one counts nothing new")
            window = replace(window, through=window.since_any)
        signals = build(cur, window, nightly)
        cur.execute(
            sql("common/signal_record"),
            {
                **key,
                "run_id": run_id,
                "nightly": nightly,
                "work_done_at": window.work_done_at,
                "drift_through": window.through,
                "signals": json.dumps(asdict(signals)),
            },
        )
    return signals, True


def publish(asset: Any, extra: dict[str, Any] | None, outlet_events: Any) -> dict[str, Any]:
    """Body of a DAG's publish task (``outlets=[asset]``): an asset event with ``extra``, or
    the task skipped (no event) when the run has no fresh data to publish (``extra`` None)."""
    if extra is None:
        from airflow.sdk.exceptions import AirflowSkipException

        raise AirflowSkipException(
            f"no fresh data for {asset.name}: not a real run that completed its work"
        )
    outlet_events[asset].extra = extra
    log.info("asset %s updated: %s", asset.name, extra)
    return extra


def task_failed(metric: str, context: dict[str, Any]) -> None:
    """on_failure_callback / on_retry_callback of every task of a job's DAG: every failed task
    attempt counts in ``<metric>_errors_total``, whichever task it is."""
    ti = context.get("task_instance") or context.get("ti")
    log.error(
        "task failed: %s.%s map_index=%s try=%s: %s",
        getattr(ti, "dag_id", "?"),
        getattr(ti, "task_id", "?"),
        getattr(ti, "map_index", "?"),
        getattr(ti, "try_number", "?"),
        context.get("exception"),
    )
    metrics.incr(f"{metric}_errors_total")


def new_result(opts: dict[str, Any], run_id: str) -> dict[str, Any]:
    """The fields of a run's result that both jobs report, before the run is counted."""
    return {
        "status": "success",
        "dry_run": opts["dry_run"],
        "item_errors": 0,
        "backlog_remaining": False,
        "duration_ms": 0,
        "run_id": run_id,
        "unfinished_sweeps": [],
    }


def elapsed_ms(lease: leases.Lease | None) -> int:
    if lease is None:
        return 0
    started = datetime.fromisoformat(lease.acquired_at)
    return int((datetime.now(UTC) - started).total_seconds() * 1000)


def parse_uuids(name: str, values: Any, errors: list[str]) -> list[str]:
    """Normalized, de-duplicated uuids of a list param; problems go to ``errors``."""
    if not isinstance(values, list):
        errors.append(f"{name} must be a list of uuids, got {type(values).__name__}")
        return []
    out: list[str] = []
    for v in values:
        try:
            if not isinstance(v, str):
                raise ValueError(v)
            out.append(str(uuid.UUID(v)))
        except ValueError:
            errors.append(f"{name} contains {v!r}, which is not a uuid")
    return sorted(set(out))


def rejoin_lease(job: JobDef, lease_data: dict[str, Any] | None) -> leases.Lease:
    """The lease of this run, taken again when it is gone (see :func:`lease.rejoin`)."""
    lease = lease_from_xcom(lease_data)
    if lease is None:
        raise leases.LeaseLost("this run holds no lease; nothing may be written")
    with connection(job.conn_id) as conn:
        return leases.rejoin(conn, lease)


def _range_start(
    job: JobDef, rng: dict[str, Any], batch_size: int, run_id: str, extra: dict[str, Any] | None
) -> dict[str, Any]:
    return {
        "pin.job": job.dag_id,
        "pin.job_run_id": run_id,
        "pin.sweep_id": rng["sweep_id"],
        "pin.scope": rng["family"],
        "pin.range": rng["label"],
        "pin.range_no": rng["range_no"],
        "pin.batch_size": batch_size,
        **(extra or {}),
    }


def _range_result(res: keyset.RangeResult) -> dict[str, Any]:
    return {
        "pin.range.status": res.status,
        **res.attributes("pin.range", omit=("written", "retried")),
        "pin.range.cursor": res.cursor_id,
    }


def run_range_task(
    job: JobDef,
    rng: dict[str, Any],
    lease_data: dict[str, Any],
    batch_size: int,
    work: keyset.SweepJob,
    run_id: str,
    span_attributes: dict[str, Any] | None = None,
    guard: Callable[[Any], str | None] | None = None,
) -> dict[str, Any]:
    """Body of a mapped range task: work through the range (the job's ``work`` on its sweep),
    stop gracefully. A range that is no longer this run's (a later run adopted it, or its sweep
    was abandoned for a newer date: the task was cleared late), or for which the job's
    ``guard(cur)`` says why the run may write nothing, writes nothing and ends green, saying
    which run took over."""
    with (
        tracing.in_run((lease_data or {}).get("trace")),
        tracing.span("range", _range_start, job, rng, batch_size, run_id, span_attributes) as span,
    ):
        taken = lease_from_xcom(lease_data)
        if taken is None:
            raise leases.LeaseLost("this run holds no lease; nothing may be written")
        # one connection for the whole task: the check, the lease, every batch
        with connection(job.conn_id) as conn:
            why = keyset.superseded(keyset.get_range(conn, rng), taken.holder)
            if why is None and guard is not None:
                with transaction(conn) as cur:
                    why = guard(cur)
            if why is None:
                lease = leases.rejoin(conn, taken)
                with keyset.StopSignal() as stop:
                    res = keyset.run_range(conn, rng, lease, batch_size, work, stop=stop)
            else:
                log.warning("range %s: %s; this task writes nothing", rng["label"], why)
                res = keyset.RangeResult(
                    sweep_id=rng["sweep_id"],
                    range_no=rng["range_no"],
                    status="superseded",
                    superseded_by=why,
                )
        tracing.set_result(span, _range_result, res)
        out = {**res.__dict__, "label": rng["label"]}
        log.info(
            "range %(label)s %(status)s: processed=%(processed)d changed=%(changed)d "
            "written=%(written)d batches=%(batches)d skipped_locked=%(skipped_locked)d "
            "(retried %(retried)d) item_errors=%(item_errors)d",
            out,
        )
        if res.status == "stopped":
            raise keyset.GracefulStop(
                f"stopped on request after {res.batches} batch(es); "
                f"committed work is kept, cursor {res.cursor_id}"
            )
    return out


def config_errors_fail(fn: Callable) -> Callable:
    """Decorate a task callable: a configuration error fails the task at once, without
    retries."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except JobConfigError as exc:
            from airflow.sdk.exceptions import AirflowFailException

            raise AirflowFailException(str(exc)) from exc

    return wrapper
