"""Ranges: the loop a mapped task runs over one range of a sweep, batch by batch.

Each batch is one transaction: the fence (the lease is still this run's, the deadline not
passed), the job's batch (:class:`Worker`), the range's checkpoint (cursor and counters),
committed asynchronously (``common/async_commit.sql``). Between batches the range paces on the
database's health (:mod:`pin_nightly.health`) and stops on SIGTERM; rows skipped because locked
are retried once at the range's end; a row that makes a batch fail is isolated
(:func:`isolate_items`).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, Self

from pin_nightly import controls, metrics, tracing
from pin_nightly import health as healths
from pin_nightly import lease as leases
from pin_nightly.db import fetch_one_dict, first_line, sql, sqlstate, transaction

log = logging.getLogger(__name__)

LOCK_NOT_AVAILABLE = "55P03"
RETRY_LOCK_TIMEOUT_MS = 1000  # the end-of-range retry of a skipped row waits this long for its lock


@dataclass
class Worker:
    """A job's work on one sweep (``sweep_id``; None while planning), in three methods; the
    framework owns the loop, the transactions, the lease, the checkpoints and the counters."""

    opts: dict[str, Any]
    sweep_id: int | None
    run_id: str
    dag_id: ClassVar[str] = ""  # the job's DAG (the pauses metric's tag)
    job_code: ClassVar[str] = ""  # the job's code (its item errors')

    def plan(self, cur, sweep: dict[str, Any]) -> tuple[int, list[str]]:
        """A new sweep's ``(rows, inner_boundaries)``, in the transaction that creates it."""
        raise NotImplementedError

    def batch(self, cur, after_id: str | None, upper_id: str | None, limit: int) -> Batch:
        """The range's next at most ``limit`` rows in ``(after_id, upper_id]``, SKIP LOCKED."""
        raise NotImplementedError

    def retry(self, cur, ids: list[str]) -> Batch:
        """Exactly the rows ``ids`` a batch skipped because locked, waiting for their locks."""
        raise NotImplementedError

    def guard(self, cur) -> str | None:  # noqa: ARG002
        """Why a range of the sweep may write nothing any more (None: it may), checked once
        before the range's first batch."""
        return None

    @property
    def record(self) -> dict[str, Any]:
        """What an item error of its batches is recorded with (:func:`isolate_items`): the
        ids, the rows' kind and table (the first it ``writes``), and whether rows that failed
        before are tried again."""
        ids = {"job": self.job_code, "run_id": self.run_id, "sweep_id": self.sweep_id}
        retry = bool(self.opts.get("retry_failed_rows")) or self.targeted
        return {**ids, "item_kind": self.item_kind, "table": self.writes[0], "retry": retry}

    @property
    def targeted(self) -> bool:
        """Whether it works the ids a run was given (a targeted repair tries each of them)."""
        return False

    def remembered(self, cur, lower_id: str | None, upper_id: str | None) -> list[str]:  # noqa: ARG002
        """Rows of the range ``(lower_id, upper_id]`` that an earlier night left locked and
        remembered: the range takes them first (:meth:`retry` each), before its batches."""
        return []

    def taken_first(self, ids: list[str]) -> None:
        """The rows :meth:`remembered` gave that the range wrote: its batches leave them."""

    @property
    def item_kind(self) -> str | None:
        """The kind of the rows it writes, where the job has several (a card kind)."""
        return None

    @property
    def writes(self) -> tuple[str, ...]:
        """The tables a batch writes (pacing pauses while a VACUUM runs on one of them)."""
        return ()

    @property
    def span_attributes(self) -> dict[str, Any]:
        """Attributes of each batch span beyond the batch's own (e.g. the card kind)."""
        return {}


@dataclass
class Counters:
    """What a batch, a range or a run did: the counters of ``pin_nightly.sweep_range`` (its
    checkpoints' parameters, the run totals' columns) and of a range task's result."""

    batches: int = 0
    processed: int = 0  # rows worked (reconciled, recomputed)
    changed: int = 0  # rows whose value the job corrected (comments_count, popularity_score)
    written: int = 0  # other rows written (popularity snapshots)
    skipped_locked: int = 0  # rows skipped because someone else held their lock
    item_errors: int = 0  # rows a batch could not write (pin_nightly.item_error)
    retried: int = 0  # skipped rows taken on the end-of-range retry (not stored)

    def __add__(self, other: Counters) -> Self:
        """These counters plus ``other``'s (a subclass keeps its other fields)."""
        return replace(self, **{k: v + getattr(other, k) for k, v in self.as_params().items()})

    def as_params(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(Counters)}

    def attributes(self, prefix: str, omit: tuple[str, ...]) -> dict[str, int]:
        """Span attributes ``<prefix>.<counter>`` (processed: ``rows``, changed:
        ``updated_count``, the spec's name)."""
        span = {"processed": "rows", "changed": "updated_count"}
        return {
            f"{prefix}.{span.get(k, k)}": v for k, v in self.as_params().items() if k not in omit
        }


@dataclass
class Batch:
    """What one batch did: its counters (but ``batches``, ``skipped_locked``), the new cursor
    ``last_id`` (None: nothing was read), whether it was full, the rows it skipped (locked)."""

    counters: Counters
    last_id: str | None = None
    full: bool = False
    skipped_ids: list[str] = field(default_factory=list)
    ms: float = 0.0  # how long its transaction took, pacing not included

    def checkpoint(self) -> Counters:
        """What the batch adds to its range's counters."""
        return replace(self.counters, batches=1, skipped_locked=len(self.skipped_ids))

    def retaken(self) -> Counters:
        """What a retry adds to its range's counters: the rows it took are no longer skipped."""
        taken = self.counters.processed
        return replace(self.counters, skipped_locked=-taken, retried=taken)


# SQLSTATE classes of an error that one row causes (a domain trigger raising, a constraint, bad
# data): the row is isolated and recorded, the batch writes the others.
ITEM_ERROR_CLASSES = ("22", "23", "P0")
# Classes that never concern one row: the connection, the transaction (a deadlock, a
# serialization failure), resources, disk, a lock timeout or a cancel, the server, a missing
# object. They fail the batch and the task at once.
DATABASE_ERROR_CLASSES = ("08", "25", "3D", "3F", "40", "53", "54", "55", "57", "58", "F0", "XX")


def is_item_error(exc: BaseException) -> bool:
    """Whether ``exc`` may concern one row, so the batch isolates the rows that cause it: the
    item classes, and any other error of the database that is not of the database as a whole
    (row-level security's 42501, a trigger's own ERRCODE). An error outside the item classes
    that every row of a batch gets alone concerns the table, not a row
    (:func:`isolate_items`)."""
    state = sqlstate(exc)
    if not state or state[:2] in DATABASE_ERROR_CLASSES:
        return False
    return state[:2] != "42" or state == "42501"  # else a missing or mistyped object


# apply(ids) writes the rows ``ids`` and returns what it wrote; an isolation returns that and
# the ids that failed
Apply = Callable[[list[str]], list[dict[str, Any]]]
Isolated = tuple[list[dict[str, Any]], list[str]]


def isolate_items(cur, ids: list[str], apply: Apply, record: dict, item: str) -> Isolated:
    """``apply(ids)`` in the batch's transaction, under a savepoint; when a row makes it fail
    (an item error), the ids are halved and each half applied the same way, down to the rows
    that fail alone (about 2 k log n statements for k bad rows among n, not n). Those are
    recorded in ``pin_nightly.item_error`` (``record``: job, run_id, sweep_id, the rows' kind
    and table) with their row's version, and logged as ``item failed``. The rows recorded
    before and unchanged since are held apart (``record["retry"]``: not), so that a row known
    to fail never makes the fresh rows bisect, and isolated the same way: those that still fail
    alone are logged, not recorded again (their record stands). Returns what ``apply``
    returned for the rows written, and the ids that failed. When every row failed alone with
    an error outside the item classes, the error concerns the table, not a row: it is raised
    (the batch rolls back, the task fails). Every savepoint is released, rolled back or not
    (no subtransactions pile up)."""
    held = [] if record["retry"] else _held_back(cur, record, ids)
    fresh = [i for i in ids if i not in set(held)]
    errors: list[BaseException] = []
    out, failed = _isolate(cur, fresh, apply, {**record, "errors": errors}, item)
    if held:
        still = {**record, "errors": errors, "held": True}
        wrote, failing = _isolate(cur, held, apply, still, item)
        out, failed = out + wrote, failed + failing
    if len(ids) > 1 and len(failed) == len(ids) and not any(map(_of_a_row, errors)):
        raise errors[0]
    return out, failed


def _of_a_row(exc: BaseException) -> bool:
    state = sqlstate(exc)
    return bool(state) and state[:2] in ITEM_ERROR_CLASSES


def _savepointed(cur, ids: list[str], apply) -> tuple[Any, BaseException | None]:
    """``apply(ids)`` under a savepoint, released either way: its result and None, or None and
    the item error it raised (rolled back); any other error is raised."""
    cur.execute(sql("common/savepoint_item"))
    try:
        out = apply(ids)
    except Exception as exc:
        if not is_item_error(exc):
            raise
        cur.execute(sql("common/rollback_to_item"))
        cur.execute(sql("common/release_item"))
        return None, exc
    cur.execute(sql("common/release_item"))
    return out, None


def _held_back(cur, record: dict[str, Any], ids: list[str]) -> list[str]:
    cur.execute(table_sql("common/items_held", record["table"]), {**record, "ids": ids})
    return [r[0] for r in cur.fetchall()]


def table_sql(name: str, table: str) -> str:
    """Statement ``name`` about the rows of ``table`` (a job's own table name, never input)."""
    return sql(name).replace("{item_table}", table)


def _isolate(cur, ids: list[str], apply: Apply, record: dict, item: str) -> Isolated:
    if not ids:
        return [], []
    out, exc = _savepointed(cur, ids, apply)
    if exc is None:
        return out, []
    if len(ids) == 1:
        record["errors"].append(exc)
        if record.get("held"):  # recorded before, unchanged since: its record stands
            log.warning(
                "item still failing, unchanged since it was recorded: %s=%s: %s",
                item,
                ids[0],
                first_line(exc),
            )
        else:
            _record_item_error(cur, record, item, ids[0], exc)
        return [], list(ids)
    log.warning("%d rows failed on a row (%s): isolating it by halves", len(ids), exc)
    half = len(ids) // 2
    first, failed = _isolate(cur, ids[:half], apply, record, item)
    second, more = _isolate(cur, ids[half:], apply, record, item)
    return first + second, failed + more


def _record_item_error(cur, record: dict[str, Any], item: str, item_id: str, exc) -> None:
    message = first_line(exc)
    state = sqlstate(exc)
    kind = record.get("item_kind")  # card_id: card_kind=<kind> first, as the spec names them
    about = f"{item.rsplit('_', 1)[0]}_kind={kind} " if kind else ""
    log.error("item failed: %s%s=%s sqlstate=%s: %s", about, item, item_id, state, message)
    error = {"item_id": item_id, "sqlstate": state, "message": message}
    cur.execute(table_sql("common/item_error_record", record["table"]), {**record, **error})


class StopSignal:
    """Graceful stop between batches on SIGTERM (the host stopping, a task being killed)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        log.warning("SIGTERM received: stopping after the batch in flight")
        self.requested = True

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


class GracefulStop(RuntimeError):
    """Raised after a graceful stop so that Airflow records the task as not finished."""


@dataclass(kw_only=True)
class RangeResult(Counters):
    """What a range task did: its counters, where its cursor is, and how it ended."""

    sweep_id: int
    range_no: int
    status: str  # done | interrupted | stopped | superseded
    cursor_id: str | None = None
    superseded_by: str | None = None


def superseded(row: dict[str, Any], owner: str) -> str | None:
    """Why the range of ``range_get`` row is no longer ``owner``'s to work (None: it is, or it
    is done and there is nothing to write)."""
    if row["status"] == "done" or (row["owner"] == owner and row["sweep_status"] == "open"):
        return None
    return f"superseded by the run {row['superseded_by']} (sweep {row['sweep_status']})"


def get_range(conn, rng: dict[str, Any]) -> dict[str, Any]:
    key = {"sweep_id": rng["sweep_id"], "range_no": rng["range_no"]}
    with transaction(conn) as cur:
        cur.execute(sql("common/range_get"), key)
        row = fetch_one_dict(cur)
    if row is None:
        raise LookupError(f"range {key} does not exist (was the sweep pruned?)")
    return row


def run_range(
    conn,
    rng: dict[str, Any],
    lease: leases.Lease,
    batch_size: int,
    job: Worker,
    stop: StopSignal | None = None,
    health: healths.Health | None = None,
) -> RangeResult:
    """Work through one range, batch by batch (``job.batch``), from its saved cursor.

    A range that is no longer the acquisition's (adopted by a later run, its sweep abandoned
    or closed), or whose worker's :meth:`~Worker.guard` says why it may write nothing, is left
    alone: ``superseded``, checked before the lease is taken again (:func:`lease.rejoin`: the
    lease may be gone when a task is cleared late). Stops before a batch when the run's
    deadline has passed (``interrupted``: the next run resumes) or when a stop was requested.
    Rows skipped because locked are retried once at the end of the range with a short
    ``lock_timeout`` (``job.retry``). Before each batch the range waits while the database's
    health signals are over the run's limits (``health``; by default from the job's options,
    see :mod:`pin_nightly.health`).
    """
    ids = {"sweep_id": rng["sweep_id"], "range_no": rng["range_no"]}
    row = get_range(conn, rng)
    res = RangeResult(**ids, status="done", cursor_id=row["cursor_id"])
    why = superseded(row, lease.holder)
    if why is None:
        with transaction(conn) as cur:
            why = job.guard(cur)
    if why is not None:
        log.warning("range %s: %s; this task writes nothing", rng.get("label", ids), why)
        return replace(res, status="superseded", superseded_by=why)
    if row["status"] == "done":
        log.info("range %s is already done", rng.get("label", ids))
        return res
    lease = leases.rejoin(conn, lease)
    key, share = {**ids, "owner": lease.holder}, rng.get("budget_share", 1.0)
    work = _Range(conn, job, lease, key, rng.get("label", ids), share)
    work.health = health or healths.Health.from_opts(job.opts, job.writes, job.dag_id)
    with work.health:
        return _work_range(work, row, batch_size, stop or StopSignal(), res)


def _work_range(work: _Range, row, batch_size: int, stop, res: RangeResult) -> RangeResult:
    size = BatchSize(batch_size, float(work.job.opts.get("batch_target_ms") or 0))
    with transaction(work.conn) as cur:
        first = work.job.remembered(cur, row["lower_id"], row["upper_id"])
    if first:
        log.info(
            "range %s: takes first %d row(s) an earlier night left locked", work.label, len(first)
        )
        res += _retry_skipped(work, first, stop, first=True)
    res, skipped = _work_batches(work, row, size, stop, res)
    if res.status == "done":
        res += _retry_skipped(work, skipped, stop)
        with transaction(work.conn) as cur:
            work.update(cur, "common/range_done", why="taken over by someone else")
    if stop.requested:
        res.status = "stopped"
    return res


@dataclass
class _Range:
    """A range being worked by an acquisition: what each of its transactions needs."""

    conn: Any
    job: Worker
    lease: leases.Lease
    key: dict[str, Any]  # sweep_id, range_no, owner: every write is conditional on them
    label: Any
    share: float  # of the run's time budget, that the range's pass may use
    health: healths.Health | None = None  # pacing before each batch

    def pace(self, stop) -> healths.Pause:
        """Before a batch, outside any transaction: wait while the database is unhealthy."""
        if self.health is None:
            return healths.Pause()
        pause = self.health.wait(self.conn, self.lease, self.share, stop, f"range {self.label}")
        self.record_pause(pause)
        return pause

    def record_pause(self, pause: healths.Pause) -> None:
        """Count a pause on the range row, by signal (what the console shows)."""
        if pause.signals:
            with transaction(self.conn) as cur:
                params = {"ms": round(pause.seconds * 1000), "signals": pause.signals}
                self.update(cur, "common/range_paused", params)

    def control(self) -> controls.Control:
        """The sweep's controls now (its own short transaction)."""
        with transaction(self.conn) as cur:
            return controls.read(cur, self.key["sweep_id"])

    def wait_resumed(self, ctl: controls.Control, stop) -> controls.Control | None:
        """While the sweep is paused from the console: recheck every :data:`controls.POLL_S`
        outside any transaction (no lock held), renewing the lease; the control once resumed
        (None: the range's budget is spent, or a stop was requested)."""
        by = f"{ctl.updated_by} at {ctl.updated_at}"
        log.warning(
            "range %s: sweep paused by %s; waiting (no lock, no transaction held)", self.label, by
        )
        metrics.incr(healths.METRIC, tags={"dag_id": self.job.dag_id, "signal": "operator"})
        started = time.monotonic()
        now = self._while_paused(ctl, stop)
        self.record_pause(healths.Pause(time.monotonic() - started, ["operator"]))
        if now is not None:
            log.info("range %s: sweep resumed by %s", self.label, now.updated_by)
        return now

    def _while_paused(self, ctl: controls.Control, stop) -> controls.Control | None:
        while ctl.paused:
            if healths.sleep_unless_stopped(controls.POLL_S, stop):
                return None
            with transaction(self.conn) as cur:
                past_deadline, renew_due = leases.fence(cur, self.lease, self.share)
                ctl = controls.read(cur, self.key["sweep_id"])
            if past_deadline:
                log.warning("range %s: budget spent while paused; it stops here", self.label)
                return None
            if renew_due:
                leases.renew(self.conn, self.lease)
        return ctl

    def update(self, cur, statement, params=None, why="taken over or closed by someone else"):
        """A write to the range row, only while it is the acquisition's (and its sweep open)."""
        cur.execute(sql(statement), {**(params or {}), **self.key})
        if cur.fetchone() is None:
            raise RuntimeError(f"range {self.key} was {why}")

    def batch(self, cursor, upper, limit: int, paused: healths.Pause) -> tuple[Batch | None, bool]:
        """One batch transaction (fencing, the job's batch, the checkpoint): the batch (None: past
        the run's deadline, nothing done), and whether the lease is due for renewal. ``paused``:
        the pause before it, for its span."""
        with (
            tracing.span("batch", _batch_start, cursor, limit, paused, self.job) as span,
            transaction(self.conn) as cur,
        ):
            cur.execute(sql("common/async_commit"))
            past_deadline, renew_due = leases.fence(cur, self.lease, self.share)
            b = None if past_deadline else self.job.batch(cur, cursor, upper, limit)
            if b is not None and self.health is not None:
                self.health.sample_lock_waiters(cur)
            if b is not None and b.last_id is not None:
                params = {**b.checkpoint().as_params(), "cursor_id": b.last_id}
                why = "taken over or closed by someone else: batch rolled back"
                self.update(cur, "common/range_advance", params, why)
            tracing.set_result(span, _batch_attributes, b)
        if b is None:
            log.warning(
                "max run duration reached%s: range %s stops at cursor %s; the next run "
                "resumes from it",
                f" (this pass's share, {self.share:.0%})" if self.share < 1 else "",
                self.label,
                cursor,
            )
        return b, renew_due

    def retry(
        self, row_id: str, timeout_ms: int, paused: healths.Pause, first: bool
    ) -> Counters | None:
        """The end-of-range retry of one skipped row (``first``: a remembered row the range
        takes first, not skipped by it), in its own transaction, waiting at most
        ``timeout_ms`` for its lock: what it adds to the range (None: past the deadline).
        ``paused``: the pause before it, for its span."""
        with (
            tracing.span("retry_locked_row", _retry_start, row_id, paused) as span,
            transaction(self.conn) as cur,
        ):
            cur.execute(sql("common/async_commit"))
            if leases.fence(cur, self.lease, self.share)[0]:
                return None
            cur.execute(sql("common/set_lock_timeout"), {"ms": str(int(timeout_ms))})
            b = self.job.retry(cur, [row_id])
            tracing.set_result(span, _batch_attributes, b)
            taken = b.counters if first else b.retaken()
            self.update(cur, "common/range_retried", taken.as_params())
        if first and b.counters.processed:
            self.job.taken_first([row_id])
        return taken


def _resume_point(row: dict[str, Any]) -> tuple[str | None, str | None, bool]:
    """Where a range goes on: ``(cursor, upper, wrapped)``. A range that starts at ``wrap_at``
    works ``(wrap_at, upper]``, then wraps to ``(lower, wrap_at]``."""
    wrap_at = row["wrap_at"]
    if wrap_at is not None and not row["wrapped"]:
        return row["cursor_id"] or wrap_at, row["upper_id"], False
    return row["cursor_id"] or row["lower_id"], wrap_at or row["upper_id"], True


# What a statement or lock timeout of a batch says with an adaptive batch size: too big a batch.
BATCH_TIMEOUTS = ("57014", LOCK_NOT_AVAILABLE)  # query_canceled (statement_timeout), lock_timeout


@dataclass
class BatchSize:
    """The rows of a range's next batch. One rule decides who wins: the run's ``batch_size``
    (``start``) is the first size; a size given from the console replaces it as the size to
    start from when the range reads it (before its next batch); with a target batch time
    (``target_ms``, the param ``batch_target_ms``; 0: off) the size then follows the database:
    after each full batch it moves toward the target (at most 1.5x up, at most halved down a
    step), it halves on a statement or lock timeout (the batch is tried again), within
    ``start / 8`` and ``start * 8`` of the size it started from."""

    start: int
    target_ms: float = 0
    now: int = 0
    given: int | None = None  # the size last given from the console

    def __post_init__(self) -> None:
        self.now = self.now or self.start
        self.low, self.high = max(1, self.start // 8), self.start * 8

    def size(self, ctl: controls.Control) -> int:
        given = ctl.settings.get("batch_size")
        if given is not None and int(given) != self.given:  # a new size from the console
            self.given = self.start = self.now = int(given)
            self.__post_init__()
        return self.now

    def after(self, b: Batch, ms: float) -> None:
        if self.target_ms and b.full and ms > 0:  # a short batch (a range's end) says nothing
            factor = min(1.5, max(0.5, self.target_ms / ms))
            self.now = min(self.high, max(self.low, round(self.now * factor)))

    def timed_out(self, exc: BaseException) -> bool:
        """After a batch failed with ``exc``: whether to try it again, halved."""
        if not self.target_ms or sqlstate(exc) not in BATCH_TIMEOUTS or self.now <= self.low:
            return False
        self.now = max(self.low, self.now // 2)
        log.warning("batch timed out (%s): batch size halved to %d", sqlstate(exc), self.now)
        return True


def _work_batches(
    work: _Range, row: dict[str, Any], size: BatchSize, stop, res: RangeResult
) -> tuple[RangeResult, list[str]]:
    """The range's batches from its cursor to its end, the deadline or a stop; the rows skipped."""
    cursor, upper, wrapped = _resume_point(row)
    skipped: list[str] = []
    if work.health is not None:  # pacing limits given from the console replace the run's
        limits = dict(work.health.limits)
        work.health.refresh = lambda: setattr(work.health, "limits", work.control().limits(limits))
    while True:
        b, renew_due, res.status = _next_batch(work, cursor, upper, size, stop)
        if b is None:
            break
        if renew_due:
            leases.renew(work.conn, work.lease)
        if b.last_id is not None:
            cursor = b.last_id
            skipped.extend(b.skipped_ids)
            res += _log_batch(work, b)
        if not b.full:
            if wrapped:
                break
            with transaction(work.conn) as cur:
                work.update(cur, "common/range_wrap")
            wrapped, cursor, upper = True, row["lower_id"], row["wrap_at"]
            log.info("range %s: reached its end, continues from its start to %s", work.label, upper)
    res.cursor_id = cursor
    return res, skipped


def _next_batch(
    work: _Range, cursor, upper, size: BatchSize, stop
) -> tuple[Batch | None, bool, str]:
    """The range's next batch after the controls and the pacing: the batch (None: none, the
    range stops), whether the lease is due for renewal, and the range's status."""
    while True:
        if stop.requested:
            return None, False, "stopped"
        ctl = work.control()  # the console's controls, before each batch
        if ctl.paused and (ctl := work.wait_resumed(ctl, stop)) is None:
            return None, False, "stopped" if stop.requested else "interrupted"
        paused = work.pace(stop)  # outside any transaction
        if stop.requested:
            continue
        started = time.monotonic()
        try:
            b, renew_due = work.batch(cursor, upper, size.size(ctl), paused)
        except Exception as exc:
            if size.timed_out(exc):
                continue
            raise
        if b is None:
            return None, False, "interrupted"
        b.ms = (time.monotonic() - started) * 1000
        size.after(b, b.ms)
        return b, renew_due, "done"


def _log_batch(work: _Range, b: Batch) -> Counters:
    done = b.checkpoint()
    rows = f"rows={done.processed} changed={done.changed} skipped_locked={done.skipped_locked}"
    log.info(
        "batch processed: range=%s %s cursor=%s lock_ms=%.1f", work.label, rows, b.last_id, b.ms
    )
    return done


def _batch_start(after_id: str | None, size: int, paused: healths.Pause, job: Worker) -> dict:
    ids = {"pin.batch.after_id": after_id, "pin.batch_size": size, "batch_size": size}
    return {**ids, **paused.attributes(), **job.span_attributes}  # batch_size: the spec's name


def _retry_start(row_id: str, paused: healths.Pause) -> dict[str, Any]:
    return {"pin.batch.row_id": row_id, **paused.attributes()}


def _batch_attributes(b: Batch | None) -> dict[str, Any]:
    if b is None:
        return {"pin.batch.stopped_at_deadline": True}
    attributes = b.checkpoint().attributes("pin.batch", omit=("batches", "retried"))
    # the spec's name of the rows updated
    return {**attributes, "pin.batch.cursor": b.last_id, "updated_count": b.counters.changed}


def _retry_skipped(work: _Range, skipped: list[str], stop, first: bool = False) -> Counters:
    """Take each skipped row once more (``first``: each remembered row), waiting at most
    :data:`RETRY_LOCK_TIMEOUT_MS` for its lock, and before each, as before a batch, waiting
    while the sweep is paused and pacing; what the rows taken add to the counters."""
    done = Counters()
    for row_id in skipped:
        ctl = work.control()  # a paused sweep writes nothing, its retries included
        if ctl.paused and work.wait_resumed(ctl, stop) is None:
            break
        paused = work.pace(stop)  # outside any transaction
        if stop.requested:
            break
        try:
            taken = work.retry(row_id, RETRY_LOCK_TIMEOUT_MS, paused, first)
        except Exception as exc:  # noqa: BLE001 - only a lock timeout is expected here
            if sqlstate(exc) != LOCK_NOT_AVAILABLE:
                raise
            log.info("row %s is still locked: left for the next run", row_id)
            continue
        if taken is None:
            break
        done += taken
    return done
