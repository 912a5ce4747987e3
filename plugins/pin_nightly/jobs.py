"""A job's definition and interface (:class:`Job`), its params, and what comes before a
run's work: the options' checks, the backfill refusal, the setup task that takes the lease."""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import Param

from pin_nightly import health as healths
from pin_nightly import lease as leases
from pin_nightly import metrics, tracing
from pin_nightly.db import (
    JobConfigError,
    check_columns,
    connection,
    ensure_schema,
    first_line,
    has_index_on,
    resolve,
    sql,
    transaction,
)
from pin_nightly.runs import LOCK_HELD

if TYPE_CHECKING:
    from pin_nightly.ranges import Worker
    from pin_nightly.runs import Pass, Run, Signals

log = logging.getLogger(__name__)

# JSON-schema pattern of a uuid param item (hyphens optional, any case); parse_uuids normalizes.
UUID_PATTERN = "^[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}$"


# The job-state tables (include/sql/schema/pin_nightly.sql) and the relation its last statement
# creates: a schema without it is older, and brought up to date (pin_nightly.db.ensure_schema).
STATE_DDL = ("pin_nightly.control_event_sweep", "schema/pin_nightly")


@dataclass(frozen=True)
class Job:
    """A job: its identity and tables as fields, and its part of a run as a few methods that
    the framework (:mod:`pin_nightly.runs`) calls; a job module defines one subclass."""

    code: str  # the job code of the spec, e.g. news-comment-reconcile
    dag_id: str  # also the prefix of its metrics
    conn_id: str
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
    completed: str = "job completed: %(status)s"  # the summary's log line (of the result)
    headline: str = ""  # what the run did, in the DAG run's note (of the result)
    # its DAG (pin_nightly.tasks): its params (airflow.sdk.Param each), the nightly cron and
    # its timezone, owner, description, tag
    params: dict[str, Any] = field(default_factory=dict)
    schedule: tuple[str, str] = ("0 3 * * *", "UTC")
    owner: str = ""
    description: str = ""
    tag: str = ""
    # its passes, in order: (the rows' kind or None, its planning task, its mapped range task)
    passes: tuple[tuple[str | None, str, str], ...] = ((None, "plan_ranges", "reconcile_range"),)
    retention_task: bool = False  # a task after the passes prunes its data (:meth:`prune`)
    asset: Any = None  # updated when a run completed its work (:meth:`asset_extra`)
    ids_param: str = ""  # the list param of a targeted repair
    writes: tuple[str, ...] = ()  # the domain tables its batches write
    # the console (pin_nightly.console): what a night's work is called (:meth:`work_done`
    # counts it), and the family whose done sweep covers every row (None: the row's kind)
    work_label: str = ""
    whole_family: str | None = None

    @property
    def lock_key(self) -> str:
        """The spec's single-flight lock key of the job."""
        return f"Pin:lock:job:scheduled:{self.code}"

    def holder(self, opts: dict[str, Any], run_id: str) -> str:
        """The lease holder, and owner of the sweeps, of the run's acquisition."""
        tag = opts.get("run_tag")
        return f"{self.dag_id}/{run_id}" + (f" ~{tag}" if tag else "")

    def tonight(self, conn, run: Run, part: str | None) -> Pass | None:
        """The sweep the planning task of ``part`` opens (None: the run may write nothing)."""
        raise NotImplementedError

    def worker(self, run: Run, rng: dict[str, Any]) -> Worker:
        """The worker of a range task (``rng`` a planned range)."""
        raise NotImplementedError

    def result(self, run: Run, **given: Any) -> dict[str, Any]:  # noqa: ARG002
        """The job's fields of the run's result, before the run is counted."""
        return {}

    def count(self, run: Run, totals: list[dict[str, Any]], result: dict[str, Any]) -> None:
        """Fill the job's fields of ``result`` from the acquisition's totals per sweep."""

    def settle(self, conn, run: Run, result: dict[str, Any]) -> None:
        """After counting: the job's own checks of the run's outcome, and its tidying."""

    def signals(self, run: Run, result: dict[str, Any], cur, window, nightly: bool) -> Signals:
        """What the run's first summary sends (see :func:`runs.summary_signals`)."""
        raise NotImplementedError

    def emit_state(self, conn) -> None:
        """The gauges of the job's state, read from the database (summary and teardown)."""

    def alert(self, run: Run, alert: dict[str, Any]) -> None:
        """Send the alert a summary's signals carry."""

    def options(self, params: dict[str, Any], instant: datetime, run_id: str, nightly: bool):
        """The run's options from its ``params`` about ``instant`` (``nightly``: a scheduled
        run, see :func:`run_type`), every rule checked; no database access."""
        raise NotImplementedError

    def check_date(self, opts: dict[str, Any], instant: datetime, backfill: bool) -> None:  # noqa: ARG002
        """Refuse, before anything is written, a run whose date the job may not work."""
        check_backfill(self, instant.date().isoformat(), backfill)

    def rows_tried(self, result: dict[str, Any]) -> int:
        """The rows a run's ``result`` tried to write, those that failed included."""
        return result["item_errors"]

    def prepare(self, conn) -> None:
        """After the job-owned tables are checked, before the lease: upgrade their layout."""

    def prune(self, run: Run) -> int:  # noqa: ARG002
        """The retention task (``retention_task``): what it pruned."""
        return 0

    def asset_extra(self, result: dict[str, Any]) -> dict[str, Any] | None:  # noqa: ARG002
        """The asset event's extra of a run's ``result`` (None: no event, nothing fresh)."""
        return None

    def work_done(self, result: dict[str, Any]) -> int:  # noqa: ARG002
        """A night's work (:attr:`work_label`) from its run's ``result``, for the console."""
        return 0

    @property
    def budget_minutes(self) -> float:
        """The DAG's default time budget."""
        return float(self.params["max_run_duration_minutes"].value)


@functools.cache
def registered() -> tuple[Job, ...]:
    """Every job of the package, in the order the console shows them."""
    from pin_nightly import catalog, news

    return (news.JOB, catalog.JOB)


def dag_settings(job: Job, params: dict[str, Any], owner: str) -> dict[str, Any]:
    """The DAG arguments both jobs' DAGs share: one run at a time and no catchup, the job's
    params, two deadline alerts (SLA: finish within the lease's default TTL of being queued,
    succeed within 26 h of the logical date; per deployment:
    ``PIN_<DAG_ID>_{RUN,STALE}_DEADLINE_SECONDS``), and every failed task attempt counted in
    ``<job>_errors_total``. Retries follow ``[core] default_task_retries`` of the deployment
    (docker-compose sets 2): a retried range resumes from its cursor."""
    from pin_nightly.deadlines import deadline_alerts

    counted = functools.partial(task_failed, job.dag_id)
    return {
        "dag_id": job.dag_id,
        "catchup": False,
        "max_active_runs": 1,
        "deadline": deadline_alerts(job.dag_id, params["lock_ttl_minutes"].value),
        "params": params,
        "default_args": {
            "owner": owner,
            "on_failure_callback": counted,
            "on_retry_callback": counted,
        },
    }


# Upper bounds of the run budget and the lease TTL: larger values overflow PostgreSQL's
# timestamps half-way through a run instead of being refused when the run is created.
MAX_RUN_MINUTES = 7 * 24 * 60
MAX_TTL_MINUTES = 14 * 24 * 60
MAX_BATCH = 100_000
MAX_RETENTION_DAYS = 3660
HISTORY_DAYS = 90  # the runbook reads three months back


def retention_param(what: str):
    """A history retention param: at least :data:`HISTORY_DAYS` (what the runbook reads), and
    applied by nightly runs only (see :func:`runs.prune_history`)."""
    return Param(
        HISTORY_DAYS,
        type="integer",
        minimum=HISTORY_DAYS,
        maximum=MAX_RETENTION_DAYS,
        description=f"Days that {what} are kept, from {HISTORY_DAYS} to {MAX_RETENTION_DAYS}; "
        "only the nightly (scheduled) runs delete older ones",
    )


def common_params(
    run_minutes: float,
    ttl_minutes: float,
    ids: str,
    ids_description: str,
    dry_run_description: str,
    ranges_per: str = "",
) -> dict[str, Any]:
    """The params both jobs have: time budget, lease TTL, targeted ids, dry run, ranges,
    history retention and pacing."""
    return {
        **budget_params(run_minutes, ttl_minutes),
        ids: Param(
            [],
            type="array",
            items={"type": "string", "pattern": UUID_PATTERN},
            description=ids_description,
        ),
        "dry_run": Param(False, type="boolean", description=dry_run_description),
        **batch_params(),
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


def batch_params() -> dict[str, Any]:
    """How a range sizes its batches and treats the rows that failed before."""
    return {
        "batch_target_ms": Param(
            0,
            type="integer",
            minimum=0,
            maximum=60_000,
            description="Batch time each range aims at, in ms: after each full batch its "
            "batch size moves toward it (at most 1.5x up, at most halved down a step, halved on "
            "a statement or lock timeout), within batch_size / 8 and batch_size * 8; 0 keeps "
            "batch_size",
        ),
        "retry_failed_rows": Param(
            False,
            type="boolean",
            description="Try alone again each row that failed before and is unchanged since "
            "(pin_nightly.item_error); otherwise a batch tries such rows together, in one "
            "statement, and records nothing new (a targeted repair always tries its ids alone)",
        ),
    }


def budget_params(run_minutes: float, ttl_minutes: float) -> dict[str, Any]:
    """The run's time budget and the lease's TTL (see :func:`check_budget`)."""
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
    }


def pace_params() -> dict[str, Any]:
    """The params of pacing on the database's health (:data:`health.LIMITS`, docs/operations.md
    "Pacing on the database's health") and of the replicas it watches."""
    out = {}
    for lim in healths.LIMITS:
        if isinstance(lim.default, bool):
            out[lim.param] = Param(
                lim.default, type="boolean", description=f"Pause batches while {lim.pauses_while}"
            )
            continue
        out[lim.param] = Param(
            lim.default,
            type="integer" if lim.integer else "number",
            minimum=0,
            description=f"Pause batches while {lim.pauses_while}; 0 turns it off",
        )
    out[healths.REPLICAS_PARAM] = Param(
        [],
        type="array",
        items={"type": "string", "minLength": 1},
        description="Airflow connections of the replicas whose replay lag paces the job "
        "(read on each replica); empty: every streaming replica in pg_stat_replication",
    )
    return out


# Params a deployment's settings may not give: what one run asks for.
PER_RUN = frozenset({"scope", "post_ids", "card_ids", "dry_run"})


def deployment_settings(
    job: Job, spec: dict[str, Any], params: dict[str, Any], conf: dict[str, Any] | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``params`` with the deployment's settings in place of the code's defaults, and the
    settings applied: a value the run's ``conf`` gives wins. The settings are read at run time
    from the Airflow Variable ``pin_nightly_<dag_id>``: a JSON object, set in the UI, a secrets
    backend or ``AIRFLOW_VAR_PIN_NIGHTLY_<DAG_ID>``. Each setting is checked against its
    param's schema before anything is written."""
    import json

    from airflow.sdk import Variable

    name = f"pin_nightly_{job.dag_id}"
    raw = Variable.get(name, default=None)
    if raw is None:
        return params, {}
    try:
        settings = json.loads(raw)
    except ValueError as exc:
        raise JobConfigError(f"Variable {name} is not JSON: {exc}") from exc
    if not isinstance(settings, dict):
        raise JobConfigError(f"Variable {name} must be a JSON object of params, got {raw!r}")
    errors = [setting_error(spec, k, v) for k, v in settings.items()]
    if errors := [e for e in errors if e]:
        raise JobConfigError(f"Variable {name}: " + "; ".join(errors))
    applied = {k: v for k, v in settings.items() if k not in (conf or {})}
    if applied:
        log.info("deployment settings (Variable %s): %s", name, applied)
    return {**params, **applied}, applied


def setting_error(spec: dict[str, Any], key: str, value: Any) -> str | None:
    """Why ``key: value`` may not be a deployment setting (None: it may)."""
    import copy

    if key not in spec or key in PER_RUN:
        allowed = ", ".join(sorted(set(spec) - PER_RUN))
        return f"{key!r} is not a setting (one of: {allowed})"
    try:
        copy.deepcopy(spec[key]).resolve(value)
    except Exception as exc:  # noqa: BLE001 - ParamValidationError, reported with the key
        return f"{key}: {first_line(exc)}"
    return None


def defaults(params: dict[str, Any]) -> dict[str, Any]:
    return {name: param.value for name, param in params.items()}


def given(defaults: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """A run's params over the defaults (keys that are no param are left out)."""
    return {**defaults, **{k: v for k, v in dict(params).items() if k in defaults}}


def refuse(errors: list[str]) -> None:
    """Fail before anything is written when the options have ``errors``."""
    if errors:
        raise JobConfigError("invalid options: " + "; ".join(errors))


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


def validate(job: Job, params: dict[str, Any], logical_date, dag_run) -> dict[str, Any]:
    """Body of a DAG's validate_options task: the run's options (:meth:`Job.options`) from its
    params over the deployment's settings, its date checked; nothing is written."""
    instant = run_instant(logical_date, dag_run.run_after)
    params, settings = deployment_settings(job, job.params, params, dag_run.conf)
    opts = job.options(params, instant, dag_run.run_id, run_type(dag_run) == "scheduled")
    opts["settings"] = settings
    job.check_date(opts, instant, run_type(dag_run) == "backfill")
    return opts


def run_instant(logical_date: datetime | None, run_after: datetime | None) -> datetime:
    """The instant a run is about: its logical date, or when it was due to run (a manual run
    triggered without a logical date)."""
    return logical_date or run_after or datetime.now(UTC)


def preflight(conn, job: Job) -> list[str]:
    """Check the domain tables, create the job-owned tables if absent; return warnings."""
    for table, columns in job.domain_columns.items():
        check_columns(conn, table, columns)
    for probe, ddl in job.owned_ddl:
        ensure_schema(conn, probe, ddl)
    job.prepare(conn)
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


def acquire_lease(job: Job, opts: dict[str, Any], run_id: str) -> dict[str, Any]:
    """The setup task: preflight checks, then take the lease for the run ``run_id``.

    When another holder has it, the run's work is skipped: the result says
    ``acquired: False`` and the planning task plans nothing (the run succeeds, doing nothing).
    """
    holder = job.holder(opts, run_id)
    for replica in opts.get(healths.REPLICAS_PARAM) or ():
        resolve(replica)  # a named replica's connection must exist before anything is written
    with connection(job.conn_id) as conn:
        warnings = preflight(conn, job)
        ttl, budget = opts["lock_ttl_minutes"], opts["max_run_duration_minutes"]
        try:
            got = leases.acquire(conn, job.lock_key, holder, ttl, budget)
        except BaseException:
            # the lease may be written and this task still fail (the connection lost after the
            # commit): the run's teardown does not run when its setup failed, so free it here
            leases.release_holder(conn, job.lock_key, holder)
            raise
    if isinstance(got, leases.LeaseHeld):
        log.warning("%s: %s (key=%s holder=%s)", job.code, LOCK_HELD, job.lock_key, got)
        return {"acquired": False, "holder": got.holder, "expires_at": got.expires_at}
    log.info("lease %s acquired: %s", job.lock_key, got)
    trace = tracing.new_run(run_attributes(job, opts, run_id, holder))
    return {**got.to_xcom(), "acquired": True, "warnings": warnings, "trace": trace}


def run_attributes(job: Job, opts: dict[str, Any], run_id: str, holder: str) -> dict[str, Any]:
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


def run_type(dag_run: Any) -> str:
    """A DAG run's type: ``scheduled`` (the nightly work; only such runs set the gauges that
    describe it: a targeted repair of 3 posts must not clear a drift alert), ``manual``,
    ``backfill`` (the trigger form's Backfill tab, ``airflow backfill create``) or
    ``asset_triggered``."""
    kind = getattr(dag_run, "run_type", "")
    return str(getattr(kind, "value", kind)).lower()


def today(job: Job) -> date:
    """The job's one clock, "today" (``include/sql/common/today.sql``: the database's current
    date in UTC), read from its database; no job-owned table is needed."""
    with connection(job.conn_id) as conn, transaction(conn) as cur:
        cur.execute(sql("common/clock"))
        return cur.fetchone()[0]


def check_backfill(job: Job, day: str, backfill: bool) -> None:
    """Refuse, before anything is written, a backfill run of a ``day`` (ISO) before yesterday
    (the job's clock): news sweeps today's rows whatever the day, so a backfill would repeat
    one run's work per day; the next run's DailyWindow reaches back to the last completed
    sweep."""
    if not backfill:
        return
    now = today(job)
    if date.fromisoformat(day) >= now - timedelta(days=1):
        return
    raise JobConfigError(
        f"backfill refused: {day} is before yesterday ({now - timedelta(days=1)}, the job's "
        "clock), and a run reads today's data, not that day's: the next run's DailyWindow "
        "reaches back to the last completed sweep; nothing was written"
    )


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
    attempt counts in ``<metric>_errors_total``, whichever task it is, but a manual run's
    configuration error (a mistyped conf: the person who triggered it sees it at once), which
    counts in ``<metric>_config_errors_total`` and pages no one. A scheduled run's is an error:
    the nightly cannot run."""
    ti = context.get("task_instance") or context.get("ti")
    exc = context.get("exception")
    config = isinstance(getattr(exc, "__cause__", None) or exc, JobConfigError)
    if config and run_type(context.get("dag_run")) == "manual":
        log.error("configuration error of a manual run: %s", exc)
        metrics.incr(f"{metric}_config_errors_total")
        return
    log.error(
        "task failed: %s.%s map_index=%s try=%s: %s",
        getattr(ti, "dag_id", "?"),
        getattr(ti, "task_id", "?"),
        getattr(ti, "map_index", "?"),
        getattr(ti, "try_number", "?"),
        exc,
    )
    metrics.incr(f"{metric}_errors_total")


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
