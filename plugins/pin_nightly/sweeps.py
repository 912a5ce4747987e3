"""Sweeps: one pass of a job over its scope, split into ranges that mapped tasks work through.

Planning splits the scope's ids (uuid v7 ``id`` order) into at most ``max_ranges`` contiguous
ranges ``(lower_id, upper_id]`` of about equal row count (:mod:`pin_nightly.ranges` works them).
A run that stops at its time budget leaves the sweep open; the next run of the same scope adopts
it and resumes from the cursors (and, for a job whose scopes share one keyset, so does the next
run of any scope: :class:`Precedence`). A new sweep of a family whose previous sweep was
abandoned unfinished queues first what that one left unreached (:func:`coverage`,
:func:`rotated`).

Nothing is parked: every run first closes the sweeps whose ranges are all done (their own run's
summary never ran) and abandons the unfinished sweeps that no run may adopt (targeted repairs
and dry runs of other runs).
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import Enum
from typing import Any

from pin_nightly import lease as leases
from pin_nightly.db import fetch_dicts, fetch_one_dict, sql, transaction

log = logging.getLogger(__name__)

MAX_RANGES = 64  # ranges of a sweep at most (max_ranges and the cuts of a rotation)


class Precedence(Enum):
    """How a real sweep stands to the job's other unfinished sweeps when a run opens it."""

    OWN = "own"  # it resumes the unfinished sweep of its own family only (a catalog pass)
    JOB = "job"  # and then every unfinished sweep of the job's other families (one keyset)
    # its family's unfinished sweep is abandoned, not adopted: the new sweep covers all it had
    # left (a DailyWindow reaches back to the last completed sweep); then as JOB
    REPLACES = "replaces"


@dataclass(frozen=True)
class SweepSpec:
    """What a job asks of the planner: the sweep's identity, and how it stands to the others.

    A *real* sweep (not targeted, not a dry run) may be adopted by a later run when this one
    leaves it unfinished, and a new one starts where its family's previous sweep stopped when
    that one was abandoned unfinished (the rows it did not reach go first: no starvation of
    the keyset's tail). A targeted or dry sweep is its run's alone."""

    job: str
    family: str  # what it covers ("FullSweep", a card kind); its sweeps replace each other
    as_of_date: str | None = None  # the date a dated sweep is for (ISO)
    # what else changes what the sweep writes (formula parameters): part of its identity, so
    # that a run with other parameters never adopts it, e.g. "window 10d half-life 3d"
    variant: str = ""
    targeted: bool = False  # restricted to ids the run was given
    dry_run: bool = False
    precedence: Precedence = Precedence.OWN
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def real(self) -> bool:
        return not self.targeted and not self.dry_run

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


# plan(cur, sweep): a new sweep's (rows, inner_boundaries), see ranges.Worker.plan
Planner = Callable[[Any, dict[str, Any]], tuple[int, list[str]]]


def open_sweep(conn, spec: SweepSpec, lease: leases.Lease, run_id: str, plan: Planner) -> dict:
    """Find, adopt or create the sweep of ``spec`` for the acquisition ``lease`` (of the run
    ``run_id``); return it with its ranges. Sweeps and ranges belong to the acquisition (the
    lease holder), not to the run id, which other deployments give their runs too.

    ``plan(cur, sweep)`` (a :meth:`ranges.Worker.plan`) returns ``(rows, inner_boundaries)``
    for a new sweep. A real sweep whose precedence is not ``OWN`` also adopts the job's other
    unfinished real sweeps, returned under ``"others"``, oldest first.
    """
    base = {"job": spec.job, "scope": spec.scope, "family": spec.family, "run_id": run_id}
    base.update(owner=lease.holder, variant=f" {spec.variant}" if spec.variant else "")
    with transaction(conn) as cur:
        _close_leftovers(cur, base)
        sweep = _find_or_adopt(cur, spec, base)
        if sweep is None:
            sweep = _create(cur, spec, base, plan)
        others = spec.real and spec.precedence is not Precedence.OWN
        sweep["others"] = _adopt_others(cur, base) if others else []
        for s in [sweep, *sweep["others"]]:
            cur.execute(sql("common/sweep_ranges"), {"sweep_id": s["sweep_id"]})
            s["ranges"] = fetch_dicts(cur)
        # the lease's fence, last: a lost lease commits nothing of this, and the lease row is
        # held (FOR SHARE) only for the commit, not through the planning
        leases.fence(cur, lease)
    return sweep


def _log_sweeps(cur, what: str, level: int = logging.WARNING) -> None:
    """Log each sweep the statement just executed returned, and ``what`` became of it."""
    for s in fetch_dicts(cur):
        log.log(level, "sweep %s (%s) of run %s %s", s["sweep_id"], s["scope"], s["run_id"], what)


def _close_leftovers(cur, base: dict[str, Any]) -> None:
    """Close the job's sweeps whose ranges are all done, and abandon the unfinished sweeps that
    no run may adopt (targeted repairs and dry runs of other acquisitions)."""
    cur.execute(sql("common/sweep_close_finished"), {**base, "keep_owner": base["owner"]})
    _log_sweeps(cur, "had all its ranges done but its summary did not run: closed now")
    cur.execute(sql("common/sweep_abandon_orphans"), base)
    _log_sweeps(
        cur,
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
    if not spec.real:
        return None
    cur.execute(sql("common/sweep_abandon_family"), base)
    cur.execute(
        sql("common/sweep_adopt"), {**base, "subsumes": spec.precedence is Precedence.REPLACES}
    )
    sweep = fetch_one_dict(cur)
    if sweep is not None:
        cur.execute(sql("common/sweep_adopt_ranges"), {**base, "sweep_id": sweep["sweep_id"]})
        log.info("sweep %s (%s) adopted: resuming from its cursors", sweep["sweep_id"], spec.scope)
        return {**sweep, "adopted": True}
    if spec.precedence is Precedence.REPLACES:
        cur.execute(sql("common/sweep_abandon_subsumed"), base)
        what = "was left unfinished: this run's new sweep covers all it had left: abandoned"
        _log_sweeps(cur, what, logging.INFO)
    return None


def _create(cur, spec: SweepSpec, base: dict[str, Any], plan) -> dict[str, Any]:
    """A new sweep, planned and split into its ranges."""
    cur.execute(
        sql("common/sweep_create"),
        {**base, "resumable": spec.real, "params": json.dumps(spec.params)},
    )
    sweep = fetch_one_dict(cur)
    total, inner = plan(cur, sweep)
    bounds = [None, *inner, None]
    ranges = [(lo, hi, None) for lo, hi in zip(bounds, bounds[1:])]
    if spec.real:
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
            "sweep %(sweep_id)s (%(scope)s) is unfinished: this run resumes it after its own", other
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
    reached.sort(key=lambda i: (i[0] is not None, i[0] or ""))  # an open lower end first
    return _merged(unreached), _merged(reached)


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
        for r in s["ranges"]:
            d = {"sweep_id": s["sweep_id"], "range_no": r["range_no"], "prefix": pfx}
            d.update(family=s["family"], lower_id=r["lower_id"], upper_id=r["upper_id"])
            out.append({**d, "label": range_label(d)})
    return out
