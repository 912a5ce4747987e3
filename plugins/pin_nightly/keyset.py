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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pin_nightly import lease as leases
from pin_nightly import tracing
from pin_nightly.db import fetch_dicts, fetch_one_dict, sql, sqlstate, transaction

log = logging.getLogger(__name__)

LOCK_NOT_AVAILABLE = "55P03"


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


def range_label(rng: dict[str, Any]) -> str:
    lo = (rng.get("lower_id") or "start")[:8]
    hi = (rng.get("upper_id") or "end")[:8]
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


def open_sweep(
    conn,
    spec: SweepSpec,
    lease: leases.Lease,
    run_id: str,
    plan: Callable[[Any, dict[str, Any]], tuple[int, list[str]]],
    prepare: Callable[[Any, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Find, adopt or create the sweep of ``spec`` for the acquisition ``lease`` (of the run
    ``run_id``); return it with its ranges. Sweeps and ranges belong to the acquisition (the
    lease holder), not to the run id, which other deployments give their runs too.

    ``prepare(cur, sweep)`` runs once for a new sweep (e.g. materialize candidates);
    ``plan(cur, sweep)`` returns ``(rows, inner_boundaries)`` for a new sweep. With
    ``spec.resume_others`` the job's other unfinished resumable sweeps are adopted too and
    returned under ``"others"``, oldest first.
    """
    owner = lease.holder
    base = {
        "job": spec.job,
        "scope": spec.scope,
        "family": spec.family,
        "run_id": run_id,
        "owner": owner,
    }
    with transaction(conn) as cur:
        cur.execute(sql("common/sweep_close_finished"), {"job": spec.job, "keep_owner": owner})
        for s in fetch_dicts(cur):
            log.warning(
                "sweep %s (%s) of run %s had all its ranges done but was never closed "
                "(its summary did not run): closed now",
                s["sweep_id"],
                s["scope"],
                s["run_id"],
            )
        cur.execute(sql("common/sweep_abandon_orphans"), base)
        for s in fetch_dicts(cur):
            log.warning(
                "sweep %s (%s) of run %s was left unfinished and cannot be resumed by "
                "another run: abandoned (trigger that repair again if still needed)",
                s["sweep_id"],
                s["scope"],
                s["run_id"],
            )
        cur.execute(sql("common/sweep_find_own"), base)
        sweep = fetch_one_dict(cur)
        adopted = False
        if sweep is None and spec.resumable:
            cur.execute(sql("common/sweep_abandon_family"), base)
            cur.execute(sql("common/sweep_adopt"), {**base, "subsumes": spec.subsumes})
            sweep = fetch_one_dict(cur)
            if sweep is not None:
                adopted = True
                cur.execute(
                    sql("common/sweep_adopt_ranges"),
                    {"sweep_id": sweep["sweep_id"], "run_id": run_id, "owner": owner},
                )
            elif spec.subsumes:
                cur.execute(sql("common/sweep_abandon_subsumed"), base)
                for s in fetch_dicts(cur):
                    log.info(
                        "sweep %s (%s) of run %s was left unfinished: this run's new sweep "
                        "covers all it had left, so it is closed as abandoned",
                        s["sweep_id"],
                        s["scope"],
                        s["run_id"],
                    )
        if sweep is None:
            cur.execute(
                sql("common/sweep_create"),
                {**base, "resumable": spec.resumable, "params": json.dumps(spec.params)},
            )
            sweep = fetch_one_dict(cur)
            if prepare is not None:
                prepare(cur, sweep)
            total, inner = plan(cur, sweep)
            bounds = [None, *inner, None]
            pairs = [(lo, hi, None) for lo, hi in zip(bounds, bounds[1:])]
            if spec.rotate:
                cur.execute(
                    sql("common/sweep_resume_point"), {**base, "sweep_id": sweep["sweep_id"]}
                )
                resume = fetch_one_dict(cur)
                if resume is not None:
                    pairs = rotated([p[:2] for p in pairs], resume["resume_after"])
                    log.info(
                        "sweep %s (%s) starts after %s, where the unfinished sweep %s stopped: "
                        "the rows it did not reach go first",
                        sweep["sweep_id"],
                        spec.scope,
                        resume["resume_after"],
                        resume["sweep_id"],
                    )
            for i, (lower, upper, wrap_at) in enumerate(pairs):
                cur.execute(
                    sql("common/range_insert"),
                    {
                        "sweep_id": sweep["sweep_id"],
                        "range_no": i,
                        "lower_id": lower,
                        "upper_id": upper,
                        "wrap_at": wrap_at,
                        "planned_rows": total // len(pairs),
                        "run_id": run_id,
                        "owner": owner,
                    },
                )
            log.info(
                "sweep %s (%s) planned: %d rows in %d range(s)",
                sweep["sweep_id"],
                spec.scope,
                total,
                len(pairs),
            )
        elif adopted:
            log.info(
                "sweep %s (%s) adopted from an earlier run: resuming from its cursors",
                sweep["sweep_id"],
                spec.scope,
            )
        sweep["adopted"] = adopted
        sweep["others"] = []
        if spec.resume_others:
            cur.execute(sql("common/sweep_adopt_unfinished"), base)
            sweep["others"] = sorted(
                fetch_dicts(cur), key=lambda s: (s["started_at"], s["sweep_id"])
            )
            for other in sweep["others"]:
                other["adopted"] = True
                cur.execute(
                    sql("common/sweep_adopt_ranges"),
                    {"sweep_id": other["sweep_id"], "run_id": run_id, "owner": owner},
                )
                log.info(
                    "sweep %s (%s) is unfinished: this run resumes it after its own",
                    other["sweep_id"],
                    other["scope"],
                )
        for s in [sweep, *sweep["others"]]:
            cur.execute(sql("common/sweep_ranges"), {"sweep_id": s["sweep_id"]})
            s["ranges"] = fetch_dicts(cur)
    return sweep


def rotated(pairs: list[tuple[str | None, str | None]], start: str) -> list:
    """The ranges ``(lower, upper]`` (None: an open end) of a keyset as ``(lower, upper,
    wrap_at)``, in the order that starts right after ``start``: the range holding ``start``
    goes first and starts there (``wrap_at``: it works ``(start, upper]``, then ``(lower,
    start]``), then the ranges after it, then those before it. Ranges are queued in that order
    (the scheduler queues mapped tasks by map index), and a single range needs no order at
    all. Ids compare as their text (lowercase hex uuids order as the uuids do)."""
    for i, (lo, hi) in enumerate(pairs):
        if (lo is None or lo < start) and (hi is None or start <= hi):
            if start == hi:  # it stopped at this range's end: the next range goes first
                return [(a, b, None) for a, b in [*pairs[i + 1 :], *pairs[: i + 1]]]
            return [(lo, hi, start), *((a, b, None) for a, b in [*pairs[i + 1 :], *pairs[:i]])]
    return [(lo, hi, None) for lo, hi in pairs]


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
class Batch:
    """What one batch did; ``last_id`` is the new cursor (None: nothing was read)."""

    last_id: str | None
    full: bool
    processed: int = 0
    changed: int = 0
    written: int = 0
    item_errors: int = 0
    skipped_ids: list[str] = field(default_factory=list)


# batch(cur, after_id, upper_id, limit, only_ids) -> Batch. With only_ids the batch takes exactly
# those rows, waiting for their locks (bounded by lock_timeout), instead of skipping locked ones.
BatchFn = Callable[[Any, "str | None", "str | None", int, "list[str] | None"], Batch]


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
            log.error("item failed: %s=%s sqlstate=%s: %s", item, item_id, sqlstate(exc), message)
            cur.execute(
                sql("common/item_error_record"),
                {
                    "job": job,
                    "run_id": run_id,
                    "sweep_id": sweep_id,
                    "item_id": item_id,
                    "sqlstate": sqlstate(exc),
                    "message": message,
                },
            )
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


@dataclass
class RangeResult:
    sweep_id: int
    range_no: int
    status: str  # done | interrupted | stopped | superseded
    batches: int = 0
    processed: int = 0
    changed: int = 0
    written: int = 0
    skipped_locked: int = 0
    item_errors: int = 0
    retried: int = 0
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
    batch: BatchFn,
    retry_lock_timeout_ms: int = 1000,
    on_batch: Callable[[Batch], None] | None = None,
    stop: StopSignal | None = None,
) -> RangeResult:
    """Work through one range, batch by batch, from its saved cursor.

    Stops before a batch when the run's deadline has passed (``interrupted``: the next run
    resumes) or when a stop was requested. Rows skipped because locked are retried once at the
    end of the range with a short ``lock_timeout``. A range that is no longer the acquisition's
    (adopted by a later run, its sweep abandoned or closed) is left alone: ``superseded``.
    """
    key = {"sweep_id": rng["sweep_id"], "range_no": rng["range_no"], "owner": lease.holder}
    row = get_range(conn, rng)
    res = RangeResult(
        sweep_id=rng["sweep_id"],
        range_no=rng["range_no"],
        status="done",
        cursor_id=row["cursor_id"],
    )
    why = superseded(row, lease.holder)
    if why is not None:
        res.status, res.superseded_by = "superseded", why
        log.warning("range %s: %s; nothing written", rng.get("label", key), why)
        return res
    if row["status"] == "done":
        log.info("range %s is already done", rng.get("label", key))
        return res
    # a range that starts at wrap_at works (wrap_at, upper], then wraps to (lower, wrap_at]
    wrap_at = row["wrap_at"]
    if wrap_at is not None and not row["wrapped"]:
        cursor, upper = row["cursor_id"] or wrap_at, row["upper_id"]
    else:
        cursor, upper = row["cursor_id"] or row["lower_id"], wrap_at or row["upper_id"]
    wrapped = wrap_at is None or row["wrapped"]
    share = rng.get("budget_share", 1.0)
    skipped: list[str] = []
    stop = stop or StopSignal()
    while True:
        if stop.requested:
            res.status = "stopped"
            break
        started = time.monotonic()
        with (
            tracing.span("batch", _batch_start, cursor, batch_size) as span,
            transaction(conn) as cur,
        ):
            cur.execute(sql("common/async_commit"))
            past_deadline, renew_due = leases.fence(cur, lease, share)
            b = None if past_deadline else batch(cur, cursor, upper, batch_size, None)
            if b is not None and b.last_id is not None:
                cur.execute(
                    sql("common/range_advance"),
                    {
                        **key,
                        "cursor_id": b.last_id,
                        "processed": b.processed,
                        "changed": b.changed,
                        "written": b.written,
                        "skipped": len(b.skipped_ids),
                        "item_errors": b.item_errors,
                    },
                )
                if cur.fetchone() is None:
                    raise RuntimeError(
                        f"range {key} was taken over or closed by someone else: batch rolled back"
                    )
            tracing.set_result(span, _batch_attributes, b)
        if b is None:
            res.status = "interrupted"
            log.warning(
                "max run duration reached%s: range %s stops at cursor %s; the next run "
                "resumes from it",
                f" (this pass's share, {share:.0%})" if share < 1 else "",
                rng.get("label", key),
                cursor,
            )
            break
        if renew_due:
            leases.renew(conn, lease)
        if b.last_id is not None:
            cursor = b.last_id
            skipped.extend(b.skipped_ids)
            res.batches += 1
            res.processed += b.processed
            res.changed += b.changed
            res.written += b.written
            res.item_errors += b.item_errors
            res.skipped_locked += len(b.skipped_ids)
            log.info(
                "batch processed: range=%s rows=%d changed=%d skipped_locked=%d "
                "cursor=%s lock_ms=%.1f",
                rng.get("label", key),
                b.processed,
                b.changed,
                len(b.skipped_ids),
                cursor,
                (time.monotonic() - started) * 1000,
            )
            if on_batch is not None:
                on_batch(b)
        if not b.full:
            if wrapped:
                break
            with transaction(conn) as cur:
                cur.execute(sql("common/range_wrap"), key)
                if cur.fetchone() is None:
                    raise RuntimeError(f"range {key} was taken over or closed by someone else")
            wrapped, cursor, upper = True, row["lower_id"], wrap_at
            log.info(
                "range %s: reached its end, continues from its start to %s",
                rng.get("label", key),
                upper,
            )
    res.cursor_id = cursor
    if res.status == "done":
        _retry_skipped(conn, key, lease, share, batch, skipped, retry_lock_timeout_ms, res)
        with transaction(conn) as cur:
            cur.execute(sql("common/range_done"), key)
            if cur.fetchone() is None:
                raise RuntimeError(f"range {key} was taken over by someone else")
    if stop.requested:
        res.status = "stopped"
    return res


def _batch_start(after_id: str | None, batch_size: int) -> dict[str, Any]:
    return {"pin.batch.after_id": after_id, "pin.batch_size": batch_size}


def _retry_start(row_id: str) -> dict[str, Any]:
    return {"pin.batch.row_id": row_id}


def _batch_attributes(b: Batch | None) -> dict[str, Any]:
    if b is None:
        return {"pin.batch.stopped_at_deadline": True}
    return {
        "pin.batch.rows": b.processed,
        "pin.batch.updated_count": b.changed,
        "pin.batch.written": b.written,
        "pin.batch.skipped_locked": len(b.skipped_ids),
        "pin.batch.item_errors": b.item_errors,
        "pin.batch.cursor": b.last_id,
    }


def _retry_skipped(
    conn,
    key,
    lease,
    share: float,
    batch: BatchFn,
    skipped: list[str],
    timeout_ms: int,
    res: RangeResult,
) -> None:
    """Take each skipped row once more, waiting at most ``timeout_ms`` for its lock."""
    for row_id in skipped:
        try:
            with (
                tracing.span("retry_locked_row", _retry_start, row_id) as span,
                transaction(conn) as cur,
            ):
                cur.execute(sql("common/async_commit"))
                if leases.fence(cur, lease, share)[0]:
                    break
                cur.execute(sql("common/set_lock_timeout"), {"ms": str(int(timeout_ms))})
                b = batch(cur, None, None, 1, [row_id])
                tracing.set_result(span, _batch_attributes, b)
                cur.execute(
                    sql("common/range_retried"),
                    {
                        **key,
                        "processed": b.processed,
                        "changed": b.changed,
                        "written": b.written,
                        "item_errors": b.item_errors,
                    },
                )
                if cur.fetchone() is None:
                    raise RuntimeError(f"range {key} was taken over or closed by someone else")
        except Exception as exc:  # noqa: BLE001 - only a lock timeout is expected here
            if sqlstate(exc) != LOCK_NOT_AVAILABLE:
                raise
            log.info("row %s is still locked: left for the next run", row_id)
            continue
        res.retried += b.processed
        res.skipped_locked -= b.processed
        res.processed += b.processed
        res.changed += b.changed
        res.written += b.written
        res.item_errors += b.item_errors


def run_totals(conn, job: str, owner: str) -> list[dict[str, Any]]:
    with transaction(conn) as cur:
        cur.execute(sql("common/run_totals"), {"job": job, "owner": owner})
        return fetch_dicts(cur)


def finish_run(conn, job: str, owner: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Close the job's sweeps whose ranges are all done; return what the acquisition ``owner``
    did, per sweep, and the sweeps still unfinished after it (the backlog)."""
    totals = run_totals(conn, job, owner)
    with transaction(conn) as cur:
        cur.execute(sql("common/sweep_close_finished"), {"job": job, "keep_owner": None})
        closed = {s["sweep_id"] for s in fetch_dicts(cur)}
        cur.execute(sql("common/sweeps_unfinished"), {"job": job, "owner": owner})
        unfinished = fetch_dicts(cur)
    for t in totals:
        if t["sweep_id"] in closed:
            t["sweep_status"] = "done"
    return totals, unfinished


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
