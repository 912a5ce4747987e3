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

    @property
    def scope(self) -> str:
        """The identity as stored in ``pin_nightly.sweep.scope`` and shown in logs, e.g.
        ``FullSweep``, ``PropertyObject@2026-11-30 targeted (dry run)``."""
        return (
            self.family
            + (f"@{self.as_of_date}" if self.as_of_date else "")
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
    run_id: str,
    plan: Callable[[Any, dict[str, Any]], tuple[int, list[str]]],
    prepare: Callable[[Any, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Find, adopt or create the sweep of ``spec`` for ``run_id``; return it with its ranges.

    ``prepare(cur, sweep)`` runs once for a new sweep (e.g. materialize candidates);
    ``plan(cur, sweep)`` returns ``(rows, inner_boundaries)`` for a new sweep. With
    ``spec.resume_others`` the job's other unfinished resumable sweeps are adopted too and
    returned under ``"others"``, oldest first.
    """
    base = {"job": spec.job, "scope": spec.scope, "family": spec.family, "run_id": run_id}
    with transaction(conn) as cur:
        cur.execute(sql("common/sweep_close_finished"), {"job": spec.job, "keep_run_id": run_id})
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
            cur.execute(sql("common/sweep_adopt"), base)
            sweep = fetch_one_dict(cur)
            if sweep is not None:
                adopted = True
                cur.execute(
                    sql("common/sweep_adopt_ranges"),
                    {"sweep_id": sweep["sweep_id"], "run_id": run_id},
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
            for i in range(len(bounds) - 1):
                cur.execute(
                    sql("common/range_insert"),
                    {
                        "sweep_id": sweep["sweep_id"],
                        "range_no": i,
                        "lower_id": bounds[i],
                        "upper_id": bounds[i + 1],
                        "planned_rows": total // (len(bounds) - 1),
                        "run_id": run_id,
                    },
                )
            log.info(
                "sweep %s (%s) planned: %d rows in %d range(s)",
                sweep["sweep_id"],
                spec.scope,
                total,
                len(bounds) - 1,
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
                    {"sweep_id": other["sweep_id"], "run_id": run_id},
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
    status: str  # done | interrupted | stopped
    batches: int = 0
    processed: int = 0
    changed: int = 0
    written: int = 0
    skipped_locked: int = 0
    item_errors: int = 0
    retried: int = 0
    cursor_id: str | None = None


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
    end of the range with a short ``lock_timeout``.
    """
    key = {"sweep_id": rng["sweep_id"], "range_no": rng["range_no"]}
    with transaction(conn) as cur:
        cur.execute(sql("common/range_get"), key)
        row = fetch_one_dict(cur)
    if row is None:
        raise LookupError(f"range {key} does not exist (was the sweep pruned?)")
    res = RangeResult(
        sweep_id=rng["sweep_id"],
        range_no=rng["range_no"],
        status="done",
        cursor_id=row["cursor_id"],
    )
    if row["status"] == "done":
        log.info("range %s is already done", rng.get("label", key))
        return res
    cursor = row["cursor_id"] or row["lower_id"]
    upper = row["upper_id"]
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
            past_deadline, renew_due = leases.fence(cur, lease)
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
                    raise RuntimeError(f"range {key} was closed by someone else")
            tracing.set_result(span, _batch_attributes, b)
        if b is None:
            res.status = "interrupted"
            log.warning(
                "max run duration reached: range %s stops at cursor %s; the next run "
                "resumes from it",
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
            break
    res.cursor_id = cursor
    if res.status == "done":
        _retry_skipped(conn, key, lease, batch, skipped, retry_lock_timeout_ms, res)
        with transaction(conn) as cur:
            cur.execute(sql("common/range_done"), key)
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
    conn, key, lease, batch: BatchFn, skipped: list[str], timeout_ms: int, res: RangeResult
) -> None:
    """Take each skipped row once more, waiting at most ``timeout_ms`` for its lock."""
    for row_id in skipped:
        try:
            with (
                tracing.span("retry_locked_row", _retry_start, row_id) as span,
                transaction(conn) as cur,
            ):
                cur.execute(sql("common/async_commit"))
                if leases.fence(cur, lease)[0]:
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


def run_totals(conn, job: str, run_id: str) -> list[dict[str, Any]]:
    with transaction(conn) as cur:
        cur.execute(sql("common/run_totals"), {"job": job, "run_id": run_id})
        return fetch_dicts(cur)


def finish_run(conn, job: str, run_id: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Close the job's sweeps whose ranges are all done; return what this run did, per sweep,
    and the sweeps still unfinished after it (the backlog)."""
    totals = run_totals(conn, job, run_id)
    with transaction(conn) as cur:
        cur.execute(sql("common/sweep_close_finished"), {"job": job, "keep_run_id": None})
        closed = {s["sweep_id"] for s in fetch_dicts(cur)}
        cur.execute(sql("common/sweeps_unfinished"), {"job": job, "run_id": run_id})
        unfinished = fetch_dicts(cur)
    for t in totals:
        if t["sweep_id"] in closed:
            t["sweep_status"] = "done"
    return totals, unfinished


def write_run_log(
    conn, job: str, run_id: str, status: str, result: dict[str, Any], started_at: str | None
) -> None:
    with transaction(conn) as cur:
        cur.execute(
            sql("common/run_log_upsert"),
            {
                "job": job,
                "run_id": run_id,
                "status": status,
                "result": json.dumps(result, default=str),
                "started_at": started_at,
            },
        )
