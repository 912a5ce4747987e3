"""The run: what every task of a job's DAG does around the job's own work, written once.

A task builds one :class:`Run` (the job, the options, the run id, the lease it holds or None)
and calls the framework: :func:`plan` (the planning task), :func:`work_range` (a mapped range
task), :func:`summarize` and :func:`teardown`. The job supplies its part through the methods of
:class:`pin_nightly.jobs.Job`: tonight's sweep and its worker, its result's fields, its signals
and its state gauges.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any

from pin_nightly import controls, metrics, ranges, sweeps, tracing
from pin_nightly import lease as leases
from pin_nightly.db import connection, fetch_dicts, fetch_one_dict, sql, transaction

if TYPE_CHECKING:
    from pin_nightly.jobs import Job

log = logging.getLogger(__name__)

LOCK_HELD = "skipped, lock held"


@dataclass(frozen=True)
class Run:
    """One run of a job as a task sees it, built once per task from its inputs."""

    job: Job
    opts: dict[str, Any]
    run_id: str
    lease: leases.Lease | None = None  # None: the run did not get the lease
    trace: dict[str, Any] | None = None  # the run's job_run span context

    @classmethod
    def of(cls, job: Job, opts: dict[str, Any], run_id: str, lease_data=None) -> Run:
        """The run of a task given the setup task's result ``lease_data`` (an XCom)."""
        data = lease_data or {}
        lease = leases.Lease.from_xcom(data) if data.get("acquired") else None
        return cls(job, opts, run_id, lease, data.get("trace"))

    @property
    def holder(self) -> str:
        """The lease holder, and owner of the sweeps, of the run's acquisition."""
        return self.lease.holder if self.lease else self.job.holder(self.opts, self.run_id)

    @property
    def dry_run(self) -> bool:
        return bool(self.opts["dry_run"])

    def connect(self):
        return connection(self.job.conn_id)

    def held(self) -> leases.Lease:
        """The run's lease; :class:`lease.LeaseLost` when it took none."""
        if self.lease is None:
            raise leases.LeaseLost("this run holds no lease; nothing may be written")
        return self.lease


@dataclass(frozen=True)
class Pass:
    """The sweep a planning task opens: its spec, the worker that plans and works it, the
    label prefix of its ranges and the share of the run's budget they may use."""

    spec: sweeps.SweepSpec
    worker: ranges.Worker
    prefix: str
    share: float = 1.0


def plan(run: Run, part: str | None = None) -> list[dict[str, Any]]:
    """The planning task: open (or adopt) the run's sweep of ``part`` (the job's
    :meth:`~pin_nightly.jobs.Job.tonight`) and return its ranges (none when the lease is held
    or the job says the run may write nothing)."""
    if run.lease is None:
        log.warning("%s: %s; nothing planned", run.job.code, LOCK_HELD)
        return []
    with run.connect() as conn:
        p = run.job.tonight(conn, run, part)
        if p is None:
            return []
        # the run's lease, taken again if it is gone (a planning task cleared after its run's
        # summary released it); opened under its fence
        lease = leases.rejoin(conn, run.held())
        sweep = sweeps.open_sweep(conn, p.spec, lease, run.run_id, p.worker.plan)
    out = sweeps.range_descriptors(sweep, p.prefix)
    for r in out:
        r["budget_share"] = p.share
    cursors = {
        f"{s['scope']}#{r['range_no']}": r["cursor_id"] or "start"
        for s in [sweep, *sweep["others"]]
        for r in s["ranges"]
        if r["status"] != "done"
    }
    log.info(
        "job started: run=%s scope=%s batch_size=%s sweep=%s%s resumed_sweeps=%s ranges=%d "
        "cursors=%s dry_run=%s budget_share=%.0f%%",
        run.run_id,
        p.spec.scope,
        run.opts["batch_size"],
        sweep["sweep_id"],
        " (resumed)" if sweep["adopted"] else "",
        [o["sweep_id"] for o in sweep["others"]],
        len(out),
        cursors,
        run.dry_run,
        p.share * 100,
    )
    return out


def work_range(run: Run, rng: dict[str, Any]) -> dict[str, Any]:
    """A mapped range task: work through the range (the job's worker on its sweep, see
    :func:`ranges.run_range`), stop gracefully. A range that is no longer this run's (a later
    run adopted it, or its sweep was abandoned for a newer date: the task was cleared late), or
    whose worker's guard says why the run may write nothing, writes nothing and ends green,
    saying which run took over."""
    worker = run.job.worker(run, rng)
    with (
        tracing.in_run(run.trace),
        tracing.span("range", _range_start, run, rng, worker.span_attributes) as span,
    ):
        with run.connect() as conn, ranges.StopSignal() as stop:  # one connection for the task
            res = ranges.run_range(conn, rng, run.held(), run.opts["batch_size"], worker, stop)
        tracing.set_result(span, _range_result, res)
        out = {**res.__dict__, "label": rng["label"]}
        log.info(
            "range %(label)s %(status)s: processed=%(processed)d changed=%(changed)d "
            "written=%(written)d batches=%(batches)d skipped_locked=%(skipped_locked)d "
            "(retried %(retried)d) item_errors=%(item_errors)d",
            out,
        )
        if res.status == "stopped":
            raise ranges.GracefulStop(
                f"stopped on request after {res.batches} batch(es); "
                f"committed work is kept, cursor {res.cursor_id}"
            )
    return out


def _range_start(run: Run, rng: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "pin.job": run.job.dag_id,
        "pin.job_run_id": run.run_id,
        "pin.sweep_id": rng["sweep_id"],
        "pin.scope": rng["family"],
        "pin.range": rng["label"],
        "pin.range_no": rng["range_no"],
        "pin.batch_size": run.opts["batch_size"],
        **{f"pin.{k}": v for k, v in extra.items()},
    }


def _range_result(res: ranges.RangeResult) -> dict[str, Any]:
    return {
        "pin.range.status": res.status,
        **res.attributes("pin.range", omit=("written", "retried")),
        "pin.range.cursor": res.cursor_id,
    }


def summarize(run: Run, failed_tasks: int = 0, **given: Any) -> dict[str, Any]:
    """The summary task: the run's result (XCom, a row in the run log, the 'completed' log
    line) and its signals, sent once per acquisition. ``status`` is ``success`` only when no
    work is left: ``backlog_remaining`` whenever a sweep is unfinished after the run, whichever
    run left it; the job may say more (:meth:`~pin_nightly.jobs.Job.settle`). It runs after
    the work whatever became of it: when ``failed_tasks`` of the run failed (a range that failed
    for the whole database), the run is counted and logged but sends no signals, and the
    summary fails."""
    job = run.job
    result = {**new_result(run), **job.result(run, **given)}
    signals = None
    with run.connect() as conn:
        if run.lease is None:
            result["status"] = LOCK_HELD
            log.warning("%s: %s; this run did nothing", job.code, LOCK_HELD)
        else:
            _count_run(conn, run, result, failed_tasks)
            # a dry run sends nothing; a run some of whose tasks failed is logged, and its
            # signals are sent by the acquisition that finishes its work (its clear, or the
            # run that adopts its sweep), so that a spike split across them is seen whole
            if not run.dry_run and not failed_tasks:
                signals = summary_signals(conn, run, functools.partial(job.signals, run, result))
        write_run_log(conn, run, result)
        if signals is not None:  # a real run that held the lease
            job.emit_state(conn)
    log.info(job.completed, result)
    if run.lease is not None:
        release_lease(run)
        if signals is not None:
            metrics.gauge(f"{job.dag_id}_backlog_remaining", int(result["backlog_remaining"]))
            signals[0].send(signals[1], functools.partial(job.alert, run))
    if result["status"].startswith((MOSTLY_FAILED, TASKS_FAILED)):
        from airflow.sdk.exceptions import AirflowFailException

        where = "pin_nightly.item_error" if failed_tasks == 0 else "the failed tasks' logs"
        raise AirflowFailException(f"{job.code}: {result['status']} ({where})")
    return result


# The status of a run some of whose tasks failed (a range, the retention): its summary counts
# and logs what the others did, then fails.
TASKS_FAILED = "tasks failed:"


def _count_run(conn, run: Run, result: dict[str, Any], failed_tasks: int = 0) -> None:
    """What the run did (over all its acquisitions), what is left, its status."""
    totals, result["unfinished_sweeps"] = finish_run(conn, run)
    if given := controls.events_of_run(conn, run.run_id, run.held().acquired_at):
        result["controls"] = given  # from the console, with who and when
    run.job.count(run, totals, result)
    result["backlog_remaining"] = bool(result["unfinished_sweeps"])
    if result["backlog_remaining"]:
        result["status"] = "backlog_remaining"
    result["history_pruned"] = prune_history(conn, run)
    failed = _mostly_failed(conn, run, result)
    run.job.settle(conn, run, result)
    if failed_tasks and not failed:
        failed = (
            f"{TASKS_FAILED} {failed_tasks} task(s) of the run failed; the others' work is kept"
        )
    result["status"] = failed or result["status"]
    with transaction(conn) as cur:  # the lease's acquisition is on the database's clock
        cur.execute(sql("common/elapsed_ms"), {"since": run.held().acquired_at})
        result["duration_ms"] = int(cur.fetchone()[0])


# A run in which most of the rows it tried failed (and at least this many) is not a success: a
# rule of the database rejects the job's writes. Its summary fails after the run is logged and
# counted; it publishes nothing and the last-success time stays.
MOSTLY_FAILED_MIN = 10
MOSTLY_FAILED = "failed:"


def _mostly_failed(conn, run: Run, result: dict[str, Any]) -> str | None:
    """The status of a run in which most rows failed (None: not such a run); its sweeps are
    marked so that they do not count as the job's work done (``common/sweep_trusted``)."""
    failed, tried = result["item_errors"], run.job.rows_tried(result)
    if failed < MOSTLY_FAILED_MIN or failed * 2 <= tried:
        return None
    status = f"{MOSTLY_FAILED} {failed} of {tried} rows could not be written"
    with transaction(conn) as cur:
        cur.execute(
            sql("common/sweeps_mark_failed"),
            {"job": run.job.code, "owner": run.holder, "status": status},
        )
    return status


def new_result(run: Run) -> dict[str, Any]:
    """The fields of a run's result that both jobs report, before the run is counted."""
    return {
        "status": "success",
        "dry_run": run.dry_run,
        "item_errors": 0,
        "backlog_remaining": False,
        "duration_ms": 0,
        "run_id": run.run_id,
        "unfinished_sweeps": [],
        **({"settings": run.opts["settings"]} if run.opts.get("settings") else {}),
    }


def resumed(totals: list[dict[str, Any]], lease: leases.Lease) -> bool:
    """Whether the acquisition worked a sweep opened before it began (it resumed earlier
    work), from :func:`run_totals`."""
    began = datetime.fromisoformat(lease.acquired_at)
    return any(t["started_at"] < began for t in totals)


def prune_history(conn, run: Run) -> dict[str, int]:
    """Delete the job-owned history past its retention params; return the rows deleted per
    param. Only a nightly run prunes (a manual run, a targeted repair or a dry run never
    deletes history, whatever its params); the statements keep what the signals and the
    rotation still need whatever the params say."""
    if run.dry_run or not run.opts.get("nightly"):
        return {}
    pruned: dict[str, int] = {}
    with transaction(conn) as cur:
        for param, statement in run.job.history:
            cur.execute(sql(statement), {"job": run.job.code, "days": run.opts[param]})
            pruned[param] = pruned.get(param, 0) + cur.rowcount
    if any(pruned.values()):
        log.info("job history past its retention deleted: %s", pruned)
    return pruned


def release_lease(run: Run) -> bool:
    """Release the lease if this run holds it: the teardown task, and the summary (the
    teardown does not run again when only a run's failed tasks are cleared)."""
    if run.lease is None:
        log.info("no lease was taken by this run: nothing to release")
        return False
    with run.connect() as conn:
        return leases.release(conn, run.lease)


def teardown(run: Run) -> bool:
    """The teardown task: release the lease, then send the job's state gauges (on the same
    connection: the teardown runs when the summary failed, and the work a run completed is
    then still seen) and the run's ``job_run`` span, from the acquisition to now."""
    if run.lease is None:
        log.info("no lease was taken by this run: nothing to release")
        return False
    with run.connect() as conn:
        released = leases.release(conn, run.lease)
        run.job.emit_state(conn)
    tracing.end_run(run.trace, datetime.fromisoformat(run.lease.acquired_at))
    return released


def run_totals(conn, job: str, run_id: str) -> list[dict[str, Any]]:
    """What the run ``run_id`` did, per sweep: the sweep and its ``counters``, over all the
    run's acquisitions (a whole-run clear's takes the run's ranges with their counters)."""
    with transaction(conn) as cur:
        cur.execute(sql("common/run_totals"), {"job": job, "run_id": run_id})
        rows = fetch_dicts(cur)
    names = [f.name for f in fields(ranges.Counters)]
    for r in rows:
        r["counters"] = ranges.Counters(**{n: r.pop(n) for n in names if n in r})
    return rows


def finish_run(conn, run: Run) -> tuple[list[dict[str, Any]], list[str]]:
    """Close the job's sweeps whose ranges are all done; return what the run did, per sweep
    (see :func:`run_totals`), and the sweeps still unfinished after it (the backlog), e.g.
    ``FullSweep (sweep 12)``."""
    job = run.job.code
    totals = run_totals(conn, job, run.run_id)
    closed = close_finished(conn, job)
    with transaction(conn) as cur:
        cur.execute(sql("common/sweeps_unfinished"), {"job": job, "owner": run.holder})
        unfinished = fetch_dicts(cur)
    for t in totals:
        if t["sweep_id"] in closed:
            t["sweep_status"] = "done"
    return totals, [f"{u['scope']} (sweep {u['sweep_id']})" for u in unfinished]


def close_finished(conn, job: str) -> set[int]:
    """Close the job's open sweeps whose ranges are all done, whoever left them; their ids."""
    with transaction(conn) as cur:
        cur.execute(sql("common/sweep_close_finished"), {"job": job, "keep_owner": None})
        return {s["sweep_id"] for s in fetch_dicts(cur)}


def write_run_log(conn, run: Run, result: dict[str, Any]) -> None:
    """The run's row in the run log; a run that found the lease held writes one that never
    replaces one of a run with the same id that worked."""
    started_at = run.lease.acquired_at if run.lease else None
    row = {"job": run.job.code, "run_id": run.run_id, "status": result["status"]}
    row.update(started_at=started_at, lock_held=started_at is None)
    with transaction(conn) as cur:
        cur.execute(
            sql("common/run_log_upsert"), {**row, "result": json.dumps(result, default=str)}
        )


@dataclass
class Signals:
    """What a summary sends: metrics declared in :data:`metrics.METRICS` (``[name, value,
    tags]``) and an alert (``None``: no alert). Gauges describe a state and are sent again by a
    summary run again; counters, timings and the alert are sent once per acquisition.
    ``run_totals`` are counters of the run's totals (:func:`run_totals`, over all the run's
    acquisitions): an acquisition sends what the run's earlier ones have not (``whole``: the
    totals it sent up to, which the next acquisition of the run subtracts)."""

    counters: list = field(default_factory=list)
    run_totals: list = field(default_factory=list)
    timings: list = field(default_factory=list)
    gauges: list = field(default_factory=list)
    alert: dict[str, Any] | None = None
    whole: list = field(default_factory=list)

    def count_from(self, earlier: dict[str, Any] | None) -> None:
        """Send only what the run's earlier acquisition (its stored signals) did not."""
        self.whole = [list(c) for c in self.run_totals]
        sent = {_key(n, t): v for n, v, t in (earlier or {}).get("whole", [])}
        self.run_totals = [[n, max(0, v - sent.get(_key(n, t), 0)), t] for n, v, t in self.whole]

    def send(self, first: bool, alert: Callable[[dict[str, Any]], None] | None = None) -> None:
        for name, value, tags in self.gauges:
            metrics.gauge(name, value, tags=tags)
        if not first:
            log.info("this run's summary was sent before: counters and alerts not sent again")
            return
        for name, value, tags in self.counters + self.run_totals:
            metrics.incr(name, value, tags=tags)
        for name, value, tags in self.timings:
            metrics.timing(name, value, tags=tags)
        if self.alert is not None and alert is not None:
            alert(self.alert)


def _key(name: str, tags: dict[str, Any] | None) -> str:
    return json.dumps([name, tags], sort_keys=True)


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
    conn, run: Run, build: Callable[[Any, SignalWindow, bool], Signals]
) -> tuple[Signals, bool]:
    """The signals of the acquisition's summary and whether this is its first summary: built
    once by ``build(cur, window, nightly)`` and stored in ``pin_nightly.run_signal``; a summary
    run again gets the stored ones. The summary of a run older than one that already sent its
    summary (a task cleared after newer nights) counts no window and is no nightly's."""
    lease = run.held()
    run_at = run.opts.get("run_instant") or lease.acquired_at  # options of an older release
    key = {"job": run.job.code, "owner": lease.holder, "run_at": run_at}
    with transaction(conn) as cur:
        cur.execute(sql("common/signal_sent"), key)
        row = cur.fetchone()
        if row is not None:
            return Signals(**row[0]), False
        cur.execute(sql("common/signal_window"), {**key, "acquired_at": lease.acquired_at})
        window = SignalWindow(**fetch_one_dict(cur), acquired_at=lease.acquired_at)
        nightly = run.opts.get("nightly", False) and window.current
        if not window.current:
            log.warning("a newer run sent its summary: this one counts nothing new")
            window = replace(window, through=window.since_any)
        signals = build(cur, window, nightly)
        cur.execute(sql("common/signal_of_run"), {**key, "run_id": run.run_id})
        earlier = cur.fetchone()
        signals.count_from(earlier[0] if earlier else None)
        record = {"run_id": run.run_id, "nightly": nightly, "work_done_at": window.work_done_at}
        record.update(drift_through=window.through, signals=json.dumps(asdict(signals)))
        cur.execute(sql("common/signal_record"), {**key, **record})
    return signals, True
