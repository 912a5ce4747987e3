"""Sweeps over a keyset (uuid v7 ``id`` order), split into ranges that mapped tasks work through.

A *sweep* is one pass of a job over its scope. Planning splits the scope's ids into at most
``max_ranges`` contiguous ranges ``(lower_id, upper_id]`` of about equal row count; each mapped
task loops over batches inside its range, one transaction per batch, advancing the range's
cursor (the checkpoint) in the batch's own transaction, committed asynchronously (see
``common/async_commit.sql``). A run that stops at its time budget leaves the sweep open; the
next run of the same scope adopts it and resumes from the cursors, and so does the next run of
any scope of a job that asks for it (``SweepSpec.resume_others``).

Nothing is parked: every run first closes the sweeps whose ranges are all done (their own run's
summary never ran) and abandons the unfinished sweeps that no run may adopt (targeted repairs
and dry runs of other runs).
"""

from __future__ import annotations

import json
import logging
import math
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from datetime import UTC, datetime
from typing import Any, Self

from pin_nightly import health as healths
from pin_nightly import lease as leases
from pin_nightly import tracing
from pin_nightly.db import fetch_dicts, fetch_one_dict, sql, sqlstate, transaction

log = logging.getLogger(__name__)

LOCK_NOT_AVAILABLE = "55P03"
MAX_RANGES = 64  # ranges of a sweep at most (max_ranges and the cuts of a rotation)


@dataclass(frozen=True)
class SweepSpec:
    """What a job asks of the planner: the sweep's identity as fields, and how to treat it."""

    job: str
    family: str  # what it covers ("FullSweep", a card kind); its sweeps replace each other
    resumable: bool  # another run may adopt it when this run leaves it unfinished
    as_of_date: str | None = None  # the date a dated sweep is for (ISO)
    targeted: bool = False  # restricted to ids the run was given
    dry_run: bool = False
    params: dict[str, Any] = field(default_factory=dict)
    # also adopt the job's unfinished resumable sweeps of other scopes (after the own one)
    resume_others: bool = False
    # a new sweep of this scope covers everything an unfinished one of an earlier run had left
    # (a DailyWindow reaches back to the last completed sweep): that one is abandoned, and the
    # run plans its own sweep instead of adopting it (an adopted window would replace tonight's)
    subsumes: bool = False
    # what else changes what the sweep writes (formula parameters): part of its identity, so
    # that a run with other parameters never adopts it, e.g. "window 10d half-life 3d"
    variant: str = ""
    # a new sweep starts where the family's previous sweep stopped when that one was abandoned
    # unfinished (a dated pass superseded after its budget ran out): the rows it did not reach
    # go first, then the keyset wraps around (no starvation of the keyset's tail)
    rotate: bool = False

    @property
    def scope(self) -> str:
        """The identity as stored in ``pin_nightly.sweep.scope`` and shown in logs, e.g.
        ``FullSweep``, ``PropertyObject@2026-11-30 targeted (dry run)``."""
        return (
            self.family
            + (f"@{self.as_of_date}" if self.as_of_date else "")
            + (f" {self.variant}" if self.variant else "")
            + (" targeted" if self.targeted else "")
            + (" (dry run)" if self.dry_run else "")
        )


def _v7_instant(value: str) -> datetime | None:
    """The creation time a uuid v7 carries (its first 48 bits, unix ms); None for another id."""
    try:
        u = uuid.UUID(value)
    except ValueError:
        return None
    return datetime.fromtimestamp((u.int >> 80) / 1000, UTC) if u.version == 7 else None


# ever finer, until the two ends of a range read differently; the upper end drops the date
# when both ends share it
_PRECISIONS = ("%Y-%m-%d", "%Y-%m-%d %H:%M", "%Y-%m-%d %H:%M:%S", "%Y-%m-%d %H:%M:%S.%f")


def range_label(rng: dict[str, Any]) -> str:
    """The range as the UI lists it: ``FullSweep#1 (2025-11-03..2026-01-17]``, the time span
    its uuid v7 bounds cover (``start``/``end`` for an open end), or the bounds' first 8 hex
    digits for ids that are not v7."""
    bounds = (rng.get("lower_id"), rng.get("upper_id"))
    instants = [_v7_instant(b) if b else None for b in bounds]
    if any(b and t is None for b, t in zip(bounds, instants)):
        lo, hi = ((b or default)[:8] for b, default in zip(bounds, ("start", "end")))
    else:
        for fmt in _PRECISIONS:
            lo, hi = (t.strftime(fmt) if t else None for t in instants)
            if lo is None or hi is None or lo != hi:
                break
        if fmt.endswith("%f"):  # milliseconds, as the id holds them
            lo, hi = (x[:-3] if x else x for x in (lo, hi))
        if lo and hi and lo[:10] == hi[:10] and len(hi) > 10:
            hi = hi[11:]
        lo, hi = lo or "start", hi or "end"
    return f"{rng['prefix']}#{rng['range_no']} ({lo}..{hi}]"


def boundaries(
    cur, source_sql: str, params: dict[str, Any], batch_size: int, max_ranges: int
) -> tuple[int, list[str]]:
    """Row count of the keyset source and the inner range boundaries (ids) splitting it evenly."""
    cur.execute(sql("common/keyset_count").replace("{source}", source_sql), params)
    total = int(cur.fetchone()[0])
    n_ranges = max(1, min(max_ranges, math.ceil(total / max(batch_size, 1))))
    if n_ranges == 1:
        return total, []
    step = math.ceil(total / n_ranges)
    query = sql("common/keyset_next_boundary").replace("{source}", source_sql)
    inner: list[str] = []
    # boundaries at rows step, 2 * step, ... before the last row (no empty last range)
    while len(inner) < n_ranges - 1 and (len(inner) + 1) * step < total:
        cur.execute(
            query, {**params, "pin_after": inner[-1] if inner else None, "pin_skip": step - 1}
        )
        row = cur.fetchone()
        if row is None:  # rows deleted since the count
            break
        inner.append(row[0])
    return total, inner


@dataclass
class SweepJob:
    """A job's work on one sweep (``sweep_id``; None while planning), in three methods; the
    framework owns the loop, the transactions, the lease, the checkpoints and the counters."""

    opts: dict[str, Any]
    sweep_id: int | None
    run_id: str

    def plan(self, cur, sweep: dict[str, Any]) -> tuple[int, list[str]]:
        """A new sweep's ``(rows, inner_boundaries)``, in the transaction that creates it."""
        raise NotImplementedError

    def batch(self, cur, after_id: str | None, upper_id: str | None, limit: int) -> Batch:
        """The range's next at most ``limit`` rows in ``(after_id, upper_id]``, SKIP LOCKED."""
        raise NotImplementedError

    def retry(self, cur, ids: list[str]) -> Batch:
        """Exactly the rows ``ids`` a batch skipped because locked, waiting for their locks."""
        raise NotImplementedError

    @property
    def writes(self) -> tuple[str, ...]:
        """The tables a batch writes (pacing pauses while a VACUUM runs on one of them)."""
        return ()

    @property
    def span_attributes(self) -> dict[str, Any]:
        """Attributes of each batch span beyond the batch's own (e.g. the card kind)."""
        return {}


def open_sweep(
    conn,
    spec: SweepSpec,
    lease: leases.Lease,
    run_id: str,
    plan: Callable[[Any, dict[str, Any]], tuple[int, list[str]]],
) -> dict[str, Any]:
    """Find, adopt or create the sweep of ``spec`` for the acquisition ``lease`` (of the run
    ``run_id``); return it with its ranges. Sweeps and ranges belong to the acquisition (the
    lease holder), not to the run id, which other deployments give their runs too.

    ``plan(cur, sweep)`` (a job's :meth:`SweepJob.plan`) returns ``(rows, inner_boundaries)``
    for a new sweep. With ``spec.resume_others`` the job's other unfinished resumable sweeps are
    adopted too and returned under ``"others"``, oldest first.
    """
    base = {
        "job": spec.job,
        "scope": spec.scope,
        "family": spec.family,
        "run_id": run_id,
        "owner": lease.holder,
    }
    with transaction(conn) as cur:
        _close_leftovers(cur, base)
        sweep = _find_or_adopt(cur, spec, base)
        if sweep is None:
            sweep = _create(cur, spec, base, plan)
        sweep["others"] = _adopt_others(cur, base) if spec.resume_others else []
        for s in [sweep, *sweep["others"]]:
            cur.execute(sql("common/sweep_ranges"), {"sweep_id": s["sweep_id"]})
            s["ranges"] = fetch_dicts(cur)
    return sweep


def _log_sweeps(cur, level: int, what: str) -> None:
    """Log each sweep the statement just executed returned, and ``what`` became of it."""
    for s in fetch_dicts(cur):
        log.log(level, "sweep %s (%s) of run %s %s", s["sweep_id"], s["scope"], s["run_id"], what)


def _close_leftovers(cur, base: dict[str, Any]) -> None:
    """Close the job's sweeps whose ranges are all done, and abandon the unfinished sweeps that
    no run may adopt (targeted repairs and dry runs of other acquisitions)."""
    cur.execute(sql("common/sweep_close_finished"), {**base, "keep_owner": base["owner"]})
    _log_sweeps(
        cur,
        logging.WARNING,
        "had all its ranges done but was never closed (its summary did not run): closed now",
    )
    cur.execute(sql("common/sweep_abandon_orphans"), base)
    _log_sweeps(
        cur,
        logging.WARNING,
        "was left unfinished and cannot be resumed by another run: abandoned (trigger that "
        "repair again if still needed)",
    )


def _find_or_adopt(cur, spec: SweepSpec, base: dict[str, Any]) -> dict[str, Any] | None:
    """The sweep this acquisition already opened, else (a resumable scope) the unfinished one an
    earlier run left, adopted with its ranges; None when a new sweep is to be planned."""
    cur.execute(sql("common/sweep_find_own"), base)
    sweep = fetch_one_dict(cur)
    if sweep is not None:
        return {**sweep, "adopted": False}
    if not spec.resumable:
        return None
    cur.execute(sql("common/sweep_abandon_family"), base)
    cur.execute(sql("common/sweep_adopt"), {**base, "subsumes": spec.subsumes})
    sweep = fetch_one_dict(cur)
    if sweep is not None:
        cur.execute(sql("common/sweep_adopt_ranges"), {**base, "sweep_id": sweep["sweep_id"]})
        log.info(
            "sweep %s (%s) adopted from an earlier run: resuming from its cursors",
            sweep["sweep_id"],
            spec.scope,
        )
        return {**sweep, "adopted": True}
    if spec.subsumes:
        cur.execute(sql("common/sweep_abandon_subsumed"), base)
        _log_sweeps(
            cur,
            logging.INFO,
            "was left unfinished: this run's new sweep covers all it had left, so it is closed "
            "as abandoned",
        )
    return None


def _create(cur, spec: SweepSpec, base: dict[str, Any], plan) -> dict[str, Any]:
    """A new sweep, planned and split into its ranges."""
    cur.execute(
        sql("common/sweep_create"),
        {**base, "resumable": spec.resumable, "params": json.dumps(spec.params)},
    )
    sweep = fetch_one_dict(cur)
    total, inner = plan(cur, sweep)
    bounds = [None, *inner, None]
    ranges = [(lo, hi, None) for lo, hi in zip(bounds, bounds[1:])]
    if spec.rotate:
        ranges = _rotate_to_resume_point(cur, spec, base, sweep, ranges)
    base = {**base, "sweep_id": sweep["sweep_id"], "planned_rows": total // len(ranges)}
    for i, (lower, upper, wrap_at) in enumerate(ranges):
        bounds = {"lower_id": lower, "upper_id": upper, "wrap_at": wrap_at}
        cur.execute(sql("common/range_insert"), {**base, **bounds, "range_no": i})
    log.info(
        "sweep %s (%s) planned: %d rows in %d range(s)",
        sweep["sweep_id"],
        spec.scope,
        total,
        len(ranges),
    )
    return {**sweep, "adopted": False}


def _rotate_to_resume_point(cur, spec: SweepSpec, base: dict[str, Any], sweep, ranges) -> list:
    """The new sweep's ranges in the order that starts with what the family's previous sweep
    left unreached, when that one was abandoned unfinished (see :func:`rotated`)."""
    cur.execute(sql("common/sweep_previous_ranges"), {**base, "sweep_id": sweep["sweep_id"]})
    previous = fetch_dicts(cur)
    unreached, reached = coverage(previous)
    if not unreached:
        return ranges
    out = rotated([r[:2] for r in ranges], unreached, reached)
    log.info(
        "sweep %s (%s): the unfinished sweep %s left %d part(s) of the keyset unreached; "
        "they go first, in %d range(s) of %d",
        sweep["sweep_id"],
        spec.scope,
        previous[0]["sweep_id"],
        len(unreached),
        sum(1 for r in out if r[3]),
        len(out),
    )
    return [r[:3] for r in out]


def _adopt_others(cur, base: dict[str, Any]) -> list[dict[str, Any]]:
    """Adopt the job's unfinished resumable sweeps of other scopes, oldest first."""
    cur.execute(sql("common/sweep_adopt_unfinished"), base)
    others = sorted(fetch_dicts(cur), key=lambda s: (s["started_at"], s["sweep_id"]))
    for other in others:
        other["adopted"] = True
        cur.execute(sql("common/sweep_adopt_ranges"), {**base, "sweep_id": other["sweep_id"]})
        log.info(
            "sweep %s (%s) is unfinished: this run resumes it after its own",
            other["sweep_id"],
            other["scope"],
        )
    return others


Interval = tuple[str | None, str | None]  # (lower, upper] of ids; None: an open end


def _nonempty(*intervals: Interval) -> list[Interval]:
    return [(a, b) for a, b in intervals if a is None or b is None or a < b]


def _range_coverage(r: dict[str, Any]) -> tuple[list[Interval], list[Interval]]:
    """What one range of an unfinished sweep left: ``(unreached, reached)`` intervals, the
    unreached ones in the order the range would have worked them."""
    lo, hi, wrap_at, cursor = r["lower_id"], r["upper_id"], r["wrap_at"], r["cursor_id"]
    if r["status"] == "done":
        return [], [(lo, hi)]
    if wrap_at is None:  # (lower, cursor] reached
        return _nonempty((cursor or lo, hi)), (_nonempty((lo, cursor)) if cursor else [])
    if not r["wrapped"]:  # it started at wrap_at: (wrap_at, cursor] reached
        at = cursor or wrap_at
        return _nonempty((at, hi), (lo, wrap_at)), _nonempty((wrap_at, at))
    at = cursor or lo  # wrapped: (wrap_at, upper] and (lower, cursor] reached
    return _nonempty((at, wrap_at)), _nonempty((wrap_at, hi)) + (_nonempty((lo, at)) if at else [])


def _key(bound: str | None) -> tuple[bool, str]:
    return (bound is not None, bound or "")


def _merged(intervals: list[Interval]) -> list[Interval]:
    """Consecutive intervals that meet, as one."""
    out: list[Interval] = []
    for a, b in intervals:
        if out and out[-1][1] is not None and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def coverage(previous: list[dict[str, Any]]) -> tuple[list[Interval], list[Interval]]:
    """What an unfinished sweep (its ranges in the order they were queued) left unreached, in
    that order, and what it reached, in keyset order: together they cover the keyset."""
    unreached: list[Interval] = []
    reached: list[Interval] = []
    for r in previous:
        u, d = _range_coverage(r)
        unreached += u
        reached += d
    return _merged(unreached), _merged(sorted(reached, key=lambda i: _key(i[0])))


def _inside(i: Interval, piece: Interval) -> bool:
    (a, b), (lo, hi) = i, piece
    return (lo is None or (a is not None and lo <= a)) and (
        hi is None or (b is not None and b <= hi)
    )


def rotated(
    pairs: list[Interval], unreached: list[Interval], reached: list[Interval]
) -> list[tuple[str | None, str | None, None, bool]]:
    """The ranges ``(lower, upper]`` (None: an open end) of a new plan of the keyset as
    ``(lower, upper, wrap_at, unreached)``, cut where an unfinished sweep's ``unreached`` and
    ``reached`` parts (:func:`coverage`) meet, and queued so that the parts it left
    unreached go first, in the order it would have worked them, then the parts it reached.
    The scheduler queues mapped tasks by map index and runs as many at once as the pool has
    slots, so every range the unfinished sweep cut goes on before anything it had done is
    done again. More than :data:`MAX_RANGES` ranges: the plan's own cuts are dropped. Ids
    compare as their text (lowercase hex uuids order as the uuids do)."""
    pieces = [(p, True) for p in unreached] + [(p, False) for p in reached]
    ends = {b for p, _ in pieces for b in p if b is not None}
    for cuts in (ends | {b for p in pairs for b in p if b is not None}, ends):
        bounds = [None, *sorted(cuts), None]
        parts = list(zip(bounds, bounds[1:]))
        out = [(a, b, None, u) for p, u in pieces for a, b in parts if _inside((a, b), p)]
        if len(out) <= MAX_RANGES:
            return out
    return out


def range_descriptors(sweep: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
    """Small descriptors of all ranges of the sweep (and of the ``others`` it resumes, labelled
    by their own scope), for ``expand``.

    Ranges already done are included (their tasks return at once) so that a range keeps its
    map index when the planning task is cleared and re-run.
    """
    out = []
    for s, pfx in [(sweep, prefix), *((o, o["family"]) for o in sweep.get("others", []))]:
        out.extend(_descriptors(s, pfx))
    return out


def _descriptors(sweep: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
    out = []
    for r in sweep["ranges"]:
        d = {
            "sweep_id": sweep["sweep_id"],
            "range_no": r["range_no"],
            "prefix": prefix,
            "family": sweep["family"],
            "lower_id": r["lower_id"],
            "upper_id": r["upper_id"],
        }
        d["label"] = range_label(d)
        out.append(d)
    return out


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

    def checkpoint(self) -> Counters:
        """What the batch adds to its range's counters."""
        return replace(self.counters, batches=1, skipped_locked=len(self.skipped_ids))

    def retaken(self) -> Counters:
        """What a retry adds to its range's counters: the rows it took are no longer skipped."""
        taken = self.counters.processed
        return replace(self.counters, skipped_locked=-taken, retried=taken)


# SQLSTATE classes of an error that one row causes (a domain trigger raising, a constraint, bad
# data): the row is isolated and recorded, the batch writes the others. Anything else (the
# connection, disk, resources, a lock timeout, a cancel) fails the batch and the task.
ITEM_ERROR_CLASSES = ("22", "23", "P0")


def is_item_error(exc: BaseException) -> bool:
    state = sqlstate(exc)
    return bool(state) and state[:2] in ITEM_ERROR_CLASSES


def isolate_items(
    cur,
    ids: list[str],
    apply: Callable[[list[str]], list[dict[str, Any]]],
    job: str,
    run_id: str,
    sweep_id: int,
    item: str,
) -> tuple[list[dict[str, Any]], list[str]]:
    """``apply(ids)`` in the batch's transaction; when a row makes it fail (an item error),
    apply each row on its own instead, each under a savepoint, and record the rows that fail
    in ``pin_nightly.item_error`` (logged as ``item failed``). Returns what ``apply`` returned
    for the rows that were written, and the ids that failed."""
    record = {"job": job, "run_id": run_id, "sweep_id": sweep_id}
    cur.execute(sql("common/savepoint_item"))
    try:
        out = apply(ids)
    except Exception as exc:
        if not is_item_error(exc):
            raise
        cur.execute(sql("common/rollback_to_item"))
        log.warning("batch failed on a row (%s): writing its %d rows one by one", exc, len(ids))
    else:
        cur.execute(sql("common/release_item"))
        return out, []
    out, failed = [], []
    for item_id in ids:
        cur.execute(sql("common/savepoint_item"))
        try:
            out.extend(apply([item_id]))
        except Exception as exc:
            if not is_item_error(exc):
                raise
            cur.execute(sql("common/rollback_to_item"))
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            state = sqlstate(exc)
            log.error("item failed: %s=%s sqlstate=%s: %s", item, item_id, state, message)
            error = {"item_id": item_id, "sqlstate": state, "message": message}
            cur.execute(sql("common/item_error_record"), {**record, **error})
            failed.append(item_id)
        else:
            cur.execute(sql("common/release_item"))
    return out, failed


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
    job: SweepJob,
    retry_lock_timeout_ms: int = 1000,
    on_batch: Callable[[Batch], None] | None = None,
    stop: StopSignal | None = None,
    health: healths.Health | None = None,
) -> RangeResult:
    """Work through one range, batch by batch (``job.batch``), from its saved cursor.

    Stops before a batch when the run's deadline has passed (``interrupted``: the next run
    resumes) or when a stop was requested. Rows skipped because locked are retried once at the
    end of the range with a short ``lock_timeout`` (``job.retry``). A range that is no longer
    the acquisition's (adopted by a later run, its sweep abandoned or closed) is left alone:
    ``superseded``. Before each batch the range waits while the database's health signals
    are over the run's limits (``health``; by default from the job's options, see
    :mod:`pin_nightly.health`).
    """
    ids = {"sweep_id": rng["sweep_id"], "range_no": rng["range_no"]}
    key = {**ids, "owner": lease.holder}
    work = _Range(conn, job, lease, key, rng.get("label", key), rng.get("budget_share", 1.0))
    # the holder is "<dag_id>/<run_id> ~<tag>" (jobs.holder_of)
    work.health = health or healths.Health.from_opts(
        job.opts, job.writes, lease.holder.partition("/")[0]
    )
    with work.health:
        return _run_range(work, rng, batch_size, retry_lock_timeout_ms, on_batch, stop)


def _run_range(
    work: _Range, rng: dict[str, Any], batch_size: int, retry_lock_timeout_ms, on_batch, stop
) -> RangeResult:
    conn, lease = work.conn, work.lease
    ids = {k: work.key[k] for k in ("sweep_id", "range_no")}
    row = get_range(conn, rng)
    res = RangeResult(**ids, status="done", cursor_id=row["cursor_id"])
    why = superseded(row, lease.holder)
    if why is not None:
        log.warning("range %s: %s; nothing written", work.label, why)
        return replace(res, status="superseded", superseded_by=why)
    if row["status"] == "done":
        log.info("range %s is already done", work.label)
        return res
    stop = stop or StopSignal()
    res, skipped = _work_batches(work, row, batch_size, stop, on_batch, res)
    if res.status == "done":
        res += _retry_skipped(work, skipped, retry_lock_timeout_ms, stop)
        with transaction(conn) as cur:
            work.update(cur, "common/range_done", why="taken over by someone else")
    if stop.requested:
        res.status = "stopped"
    return res


@dataclass
class _Range:
    """A range being worked by an acquisition: what each of its transactions needs."""

    conn: Any
    job: SweepJob
    lease: leases.Lease
    key: dict[str, Any]  # sweep_id, range_no, owner: every write is conditional on them
    label: Any
    share: float  # of the run's time budget, that the range's pass may use
    health: healths.Health | None = None  # pacing before each batch

    def pace(self, stop) -> healths.Pause:
        """Before a batch, outside any transaction: wait while the database is unhealthy."""
        if self.health is None:
            return healths.Pause()
        return self.health.wait(self.conn, self.lease, self.share, stop, f"range {self.label}")

    def update(self, cur, statement, params=None, why="taken over or closed by someone else"):
        """A write to the range row, only while it is the acquisition's (and its sweep open)."""
        cur.execute(sql(statement), {**(params or {}), **self.key})
        if cur.fetchone() is None:
            raise RuntimeError(f"range {self.key} was {why}")

    def batch(
        self, cursor: str | None, upper: str | None, limit: int, paused: healths.Pause | None = None
    ) -> tuple[Batch | None, bool]:
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
        self, row_id: str, timeout_ms: int, paused: healths.Pause | None = None
    ) -> Counters | None:
        """The end-of-range retry of one skipped row, in its own transaction, waiting at most
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
            taken = b.retaken()
            self.update(cur, "common/range_retried", taken.as_params())
        return taken


def _resume_point(row: dict[str, Any]) -> tuple[str | None, str | None, bool]:
    """Where a range goes on: ``(cursor, upper, wrapped)``. A range that starts at ``wrap_at``
    works ``(wrap_at, upper]``, then wraps to ``(lower, wrap_at]``."""
    wrap_at = row["wrap_at"]
    if wrap_at is not None and not row["wrapped"]:
        return row["cursor_id"] or wrap_at, row["upper_id"], False
    return row["cursor_id"] or row["lower_id"], wrap_at or row["upper_id"], True


def _work_batches(
    work: _Range, row: dict[str, Any], batch_size: int, stop, on_batch, res: RangeResult
) -> tuple[RangeResult, list[str]]:
    """The range's batches from its cursor to its end, the deadline or a stop; the rows skipped."""
    cursor, upper, wrapped = _resume_point(row)
    skipped: list[str] = []
    while True:
        if stop.requested:
            res.status = "stopped"
            break
        paused = work.pace(stop)  # outside any transaction
        if stop.requested:
            continue
        started = time.monotonic()
        b, renew_due = work.batch(cursor, upper, batch_size, paused)
        if b is None:
            res.status = "interrupted"
            break
        if renew_due:
            leases.renew(work.conn, work.lease)
        if b.last_id is not None:
            cursor = b.last_id
            skipped.extend(b.skipped_ids)
            done = b.checkpoint()
            res += done
            log.info(
                "batch processed: range=%s rows=%d changed=%d skipped_locked=%d cursor=%s "
                "lock_ms=%.1f",
                work.label,
                done.processed,
                done.changed,
                done.skipped_locked,
                cursor,
                (time.monotonic() - started) * 1000,
            )
            if on_batch is not None:
                on_batch(b)
        if not b.full:
            if wrapped:
                break
            with transaction(work.conn) as cur:
                work.update(cur, "common/range_wrap")
            wrapped, cursor, upper = True, row["lower_id"], row["wrap_at"]
            log.info("range %s: reached its end, continues from its start to %s", work.label, upper)
    res.cursor_id = cursor
    return res, skipped


def _batch_start(
    after_id: str | None,
    batch_size: int,
    paused: healths.Pause | None = None,
    job: SweepJob | None = None,
) -> dict[str, Any]:
    pause = paused.attributes() if paused is not None else {}
    return {
        "pin.batch.after_id": after_id,
        "pin.batch_size": batch_size,
        "batch_size": batch_size,  # the spec's name
        **pause,
        **(job.span_attributes if job is not None else {}),
    }


def _retry_start(row_id: str, paused: healths.Pause | None = None) -> dict[str, Any]:
    return {"pin.batch.row_id": row_id, **(paused.attributes() if paused is not None else {})}


def _batch_attributes(b: Batch | None) -> dict[str, Any]:
    if b is None:
        return {"pin.batch.stopped_at_deadline": True}
    attributes = b.checkpoint().attributes("pin.batch", omit=("batches", "retried"))
    # the spec's name of the rows updated
    return {**attributes, "pin.batch.cursor": b.last_id, "updated_count": b.counters.changed}


def _retry_skipped(work: _Range, skipped: list[str], timeout_ms: int, stop) -> Counters:
    """Take each skipped row once more, waiting at most ``timeout_ms`` for its lock and pacing
    before each as before a batch; return what the rows taken add to the range's counters."""
    done = Counters()
    for row_id in skipped:
        paused = work.pace(stop)  # outside any transaction
        if stop.requested:
            break
        try:
            taken = work.retry(row_id, timeout_ms, paused)
        except Exception as exc:  # noqa: BLE001 - only a lock timeout is expected here
            if sqlstate(exc) != LOCK_NOT_AVAILABLE:
                raise
            log.info("row %s is still locked: left for the next run", row_id)
            continue
        if taken is None:
            break
        done += taken
    return done


def run_totals(conn, job: str, owner: str) -> list[dict[str, Any]]:
    """What the acquisition ``owner`` did, per sweep: the sweep and its ``counters``."""
    with transaction(conn) as cur:
        cur.execute(sql("common/run_totals"), {"job": job, "owner": owner})
        rows = fetch_dicts(cur)
    for r in rows:
        r["counters"] = Counters(**{f.name: r.pop(f.name) for f in fields(Counters) if f.name in r})
    return rows


def finish_run(conn, job: str, owner: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Close the job's sweeps whose ranges are all done; return what the acquisition ``owner``
    did, per sweep (see :func:`run_totals`), and the sweeps still unfinished after it (the
    backlog), e.g. ``FullSweep (sweep 12)``."""
    totals = run_totals(conn, job, owner)
    closed = close_finished(conn, job)
    with transaction(conn) as cur:
        cur.execute(sql("common/sweeps_unfinished"), {"job": job, "owner": owner})
        unfinished = fetch_dicts(cur)
    for t in totals:
        if t["sweep_id"] in closed:
            t["sweep_status"] = "done"
    return totals, [f"{u['scope']} (sweep {u['sweep_id']})" for u in unfinished]


def close_finished(conn, job: str) -> set[int]:
    """Close the job's open sweeps whose ranges are all done, whoever left them; return their
    ids."""
    with transaction(conn) as cur:
        cur.execute(sql("common/sweep_close_finished"), {"job": job, "keep_owner": None})
        return {s["sweep_id"] for s in fetch_dicts(cur)}


def write_run_log(
    conn, job: str, run_id: str, status: str, result: dict[str, Any], started_at: str | None
) -> None:
    """The run's row in the run log; ``started_at`` is None for a run that found the lease held
    (that row never replaces one of a run with the same id that worked)."""
    with transaction(conn) as cur:
        cur.execute(
            sql("common/run_log_upsert"),
            {
                "job": job,
                "run_id": run_id,
                "status": status,
                "result": json.dumps(result, default=str),
                "started_at": started_at,
                "lock_held": started_at is None,
            },
        )
