"""catalog_popularity_recompute: daily snapshots of the cumulative view counters of catalog
cards and a 30-day exponentially decayed ``popularity_score`` computed from their deltas.

Each batch is one transaction of two statements: read the batch's cards and compute, without
any row lock, each card's snapshot (its counter) and score (from the snapshots in the window and
that value); then, in one short statement, lock the cards ``FOR NO KEY UPDATE SKIP LOCKED``,
upsert the snapshots of those locked and write ``popularity_score`` and ``updated_at`` only where
the score changes.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field, replace
from datetime import date, datetime, timedelta
from typing import Any

import pendulum
from airflow.sdk import Asset, Param

from pin_nightly import jobs, metrics, partitions, ranges, runs, sweeps
from pin_nightly import lease as leases
from pin_nightly.db import JobConfigError, connection, fetch_dicts, fetch_one_dict, sql, transaction
from pin_nightly.jobs import parse_uuids
from pin_nightly.runs import LOCK_HELD

log = logging.getLogger(__name__)

METRIC = "catalog_popularity_recompute"
MAX_SCORE = 99999999.9999  # numeric(12,4)
# apply.sql's arrays: the values compute.sql gave each card
APPLIED = (("views", "views"), ("scores", "score"), ("inherit", "inherit"))


@dataclass(frozen=True)
class CardKind:
    name: str  # as stored in popularity_daily_views.card_kind
    table: str  # its cards table: table names come from this constant only, never from input
    tasks: str  # the DAG's tasks of its pass: plan_<tasks>, recompute_<tasks>
    result: str  # prefix of its fields in the run's result: <result>_updated, ...


# The two passes, in order.
CARD_KINDS = (
    CardKind(
        "PropertyObject",
        "catalog.property_object_cards",
        "property_objects",
        "property_object_cards",
    ),
    CardKind("Project", "catalog.project_cards", "projects", "project_cards"),
)
KINDS: dict[str, CardKind] = {k.name: k for k in CARD_KINDS}
CARD_COLUMNS = ["id", "status", "popularity_views", "popularity_score", "updated_at"]


class Popularity(jobs.Job):
    """The recompute's part of a run (see :class:`jobs.Job`): a pass per card kind."""

    def tonight(self, conn, run: runs.Run, kind: str | None) -> runs.Pass | None:
        """The pass the DAG's planning task of ``kind`` opens tonight (see :func:`pass_order`)
        for as_of_date, with its share of the run's budget; None when the run may write nothing."""
        opts = run.opts
        with transaction(conn) as cur:
            why = _backfill_guard(cur, opts)
            order = pass_order(cur, opts)
            family = order[[k.name for k in CARD_KINDS].index(kind)]
            worker = Recompute(opts, None, run.run_id, family)
            share = budget_share(cur, order[order.index(family) :], worker.source)
        if why is not None:
            log.warning("as_of_date %s: %s; this run writes nothing", opts["as_of_date"], why)
            return None
        if family != kind:
            what = "the %s pass is behind (the night before did not finish it): passes %s"
            log.info(what, order[0], " then ".join(order))
        return runs.Pass(_spec(family, opts), worker, family, share)

    def worker(self, run: runs.Run, rng: dict[str, Any]) -> Recompute:
        # the pass its planning task opened: tonight's order may differ from the DAG's
        return make_batch(rng["family"], run.opts, rng["sweep_id"], run.run_id)

    def result(self, run: runs.Run, **given: Any) -> dict[str, Any]:
        return {
            "as_of_date": run.opts["as_of_date"],
            **{f"{k.result}_{n}": 0 for n in PER_KIND for k in CARD_KINDS},
            "snapshots_written": 0,
            "snapshots_pruned": given.get("pruned") or 0,
            "scores_as_of_date": None,
            "score_staleness_hours": None,
            "targeted": bool(run.opts["card_ids"]),
            "formula_variant": formula_variant(run.opts),  # "": the nightly's
            "cards_unscored": 0,
            "resumed": False,
        }

    def count(self, run: runs.Run, totals, result: dict[str, Any]) -> None:
        for t in totals:
            c = t["counters"]
            for n, count in PER_KIND.items():
                result[f"{KINDS[t['family']].result}_{n}"] += getattr(c, count)
            result["snapshots_written"] += c.written
            result["item_errors"] += c.item_errors
        result["resumed"] = runs.resumed(totals, run.lease)

    def settle(self, conn, run: runs.Run, result: dict[str, Any]) -> None:
        """A run that may write nothing says so in its status (but a summary cleared after
        newer nights keeps the status its run's summary logged; else ``success`` only when both
        passes of ``as_of_date`` completed and no sweep is left unfinished); the staleness figures
        come from the newest as_of_date whose passes all completed, whichever run completed them;
        a dry run reports what it would have written."""
        with transaction(conn) as cur:
            why = _backfill_guard(cur, run.opts)
            cur.execute(sql("common/run_log_status"), {"job": JOB.code, "run_id": run.run_id})
            logged = (cur.fetchone() or [None])[0]
            cur.execute(sql("catalog/scored_date"), {"job": JOB.code, "passes": len(KINDS)})
            scored = fetch_one_dict(cur)
        if why is not None:  # a late summary of a run that ended well keeps what it logged
            kept = logged in ("success", "backlog_remaining")
            result["status"] = logged if kept else f"nothing written: {why}"
        if scored is not None:
            result["scores_as_of_date"] = scored["as_of_date"].isoformat()
            result["score_staleness_hours"] = round(scored["staleness_hours"], 3)
            result["cards_unscored"] = scored["cards_unscored"]
        if run.dry_run:  # nothing was written: report what would have been
            result["dry_run_report"] = {k: result[k] for k in DRY_RUN_FIELDS}
            result.update({k: 0 for k in DRY_RUN_FIELDS})

    def signals(self, run: runs.Run, result, cur, window, nightly: bool) -> runs.Signals:  # noqa: ARG002
        """What the run's first summary sends: what it did, and the time its work completed."""
        opts = run.opts
        cards = (
            [f"{METRIC}_cards_total", result[f"{k.result}_processed"], {"card_kind": k.name}]
            for k in CARD_KINDS
        )
        signals = runs.Signals(
            counters=[[f"{METRIC}_snapshots_total", result["snapshots_pruned"], {"op": "pruned"}]],
            run_totals=[
                *cards,
                [f"{METRIC}_snapshots_total", result["snapshots_written"], {"op": "written"}],
                [f"{METRIC}_errors_total", result["item_errors"], None],
            ],
            # the exporter's mapping turns the milliseconds into the spec's seconds
            timings=[[f"{METRIC}_duration_seconds", result["duration_ms"], None]],
        )
        # success means the nightly work was done: both passes, nothing left, not a targeted run,
        # the nightly's formula
        if result["status"] == "success" and not opts["card_ids"] and not formula_variant(opts):
            done = window.work_done_at.timestamp()
            signals.gauges.append([f"{METRIC}_last_success_timestamp_seconds", done, None])
        return signals

    def emit_state(self, conn) -> None:
        """The gauges of how fresh the scores are, from the database: the newest as_of_date whose
        passes all completed and its age. Sent by the summary and again by the teardown, which runs
        when the summary failed (a complete night whose summary was lost is still seen)."""
        runs.close_finished(conn, JOB.code)
        with transaction(conn) as cur:
            cur.execute(sql("catalog/scored_date"), {"job": JOB.code, "passes": len(KINDS)})
            scored = fetch_one_dict(cur)
        if scored is not None:
            metrics.gauge("catalog_popularity_score_staleness_hours", scored["staleness_hours"])
            metrics.gauge(f"{METRIC}_scored_date_timestamp_seconds", scored["as_of_epoch"])
            # cards a night could not take (locked by others through its retry): not fresh
            metrics.gauge(f"{METRIC}_cards_unscored", scored["cards_unscored"])

    def options(self, params, instant, run_id, nightly: bool) -> dict[str, Any]:
        return validate_options(params, instant, run_id, nightly)

    def check_date(self, opts: dict[str, Any], instant, backfill: bool) -> None:  # noqa: ARG002
        check_as_of_date(opts)

    def prune(self, run: runs.Run) -> int:
        return retention(run)

    def asset_extra(self, result: dict[str, Any]) -> dict[str, Any] | None:
        """The extra of the scores' asset event for a run's result, or None when the run published
        no fresh scores: only a real run (not dry, not targeted) that completed both passes of its
        as_of_date with the nightly's formula and left nothing unfinished."""
        if (
            result["status"] != "success"
            or result["dry_run"]
            or result.get("targeted")
            or result.get("formula_variant")
            or result["scores_as_of_date"] != result["as_of_date"]
        ):
            return None
        return {
            "as_of_date": result["as_of_date"],
            "cards_scored": sum(result[f"{k.result}_processed"] for k in CARD_KINDS),
            "snapshots_written": result["snapshots_written"],
            "resumed": result["resumed"],
            "run_id": result["run_id"],
        }

    def rows_tried(self, result: dict[str, Any]) -> int:
        return sum(result[f"{k.result}_processed"] for k in CARD_KINDS)  # failures included

    def work_done(self, result: dict[str, Any]) -> int:
        return sum(int(result.get(f"{k.result}_updated") or 0) for k in CARD_KINDS)

    def prepare(self, conn) -> None:
        partitions.prepare(conn)  # the layout checked: the previous release's one table too


_MAX_WINDOW_DAYS = 3660  # larger overflows PostgreSQL's dates half-way through a run

# The DAG's params (see news.PARAMS).
PARAMS = {
    "window_days": Param(
        30,
        type="integer",
        minimum=1,
        maximum=_MAX_WINDOW_DAYS,
        description=f"Window W in days, an integer from 1 to {_MAX_WINDOW_DAYS} (retention "
        "always keeps the nightly 30 days + 2)",
    ),
    "half_life_days": Param(
        7,
        type="number",
        exclusiveMinimum=0,
        description="Half-life H of a day's views, in days (a number > 0)",
    ),
    "batch_size": Param(
        1000,
        type="integer",
        minimum=1,
        maximum=jobs.MAX_BATCH,
        description=f"Cards per batch, an integer from 1 to {jobs.MAX_BATCH}",
    ),
    **jobs.common_params(
        30,
        45,
        "card_ids",
        "Targeted recompute of just these cards (either kind): one uuid per line, "
        "e.g. 0190a000-0000-7000-8000-000000000000",
        "Compute and report, write nothing",
        ranges_per=" per pass",
    ),
}
DEFAULTS: dict[str, Any] = jobs.defaults(PARAMS)


# Published when a run completed both passes of its as_of_date: other teams' DAGs schedule on
# it by this name.
SCORES_ASSET = Asset("catalog_popularity_scores")

JOB = Popularity(
    code="catalog-popularity-recompute",
    dag_id="catalog_popularity_recompute",
    conn_id="catalog_db",
    domain_columns={k.table: CARD_COLUMNS for k in CARD_KINDS},
    owned_ddl=[
        jobs.STATE_DDL,
        ("catalog.popularity_daily_views", "schema/catalog_popularity"),
    ],
    headline="%(as_of_date)s, %(property_object_cards_updated)s property-object and "
    "%(project_cards_updated)s project cards updated, %(item_errors)s failed, scores as of "
    "%(scores_as_of_date)s",
    completed="run completed: PropertyObjectCardsUpdated=%(property_object_cards_updated)s "
    "ProjectCardsUpdated=%(project_cards_updated)s "
    "SnapshotsWritten=%(snapshots_written)s SnapshotsPruned=%(snapshots_pruned)s "
    "ItemErrors=%(item_errors)s DurationMs=%(duration_ms)s status=%(status)s "
    "scores_as_of_date=%(scores_as_of_date)s unfinished_sweeps=%(unfinished_sweeps)s",
    params=PARAMS,
    owner="PIN Marketplace (Catalog squad)",
    description="Nightly popularity snapshots and 30-day decayed popularity_score of catalog "
    "cards, at 03:00 UTC",
    tag="catalog",
    # one pass per card kind, in order: plan_<kind>, then its mapped ranges recompute_<kind>
    passes=tuple((k.name, f"plan_{k.tasks}", f"recompute_{k.tasks}") for k in CARD_KINDS),
    retention_task=True,
    asset=SCORES_ASSET,
    ids_param="card_ids",
    writes=tuple(k.table for k in CARD_KINDS),
    work_label="cards updated",
)


# The result's fields of each card kind (<CardKind.result>_<field>), from the passes' counters.
PER_KIND = {"updated": "changed", "processed": "processed", "skipped_locked": "skipped_locked"}
# In a dry run these stay 0 in the result; dry_run_report holds what the run would have done.
DRY_RUN_FIELDS = (
    *(f"{k.result}_updated" for k in CARD_KINDS),
    "snapshots_written",
    "snapshots_pruned",
)


def card_sql(name: str, kind: str) -> str:
    text = sql(f"catalog/{name}").replace("{cards}", KINDS[kind].table)
    return text.replace("{uuid7_now}", sql("common/uuid7_now"))


def validate_options(
    params: dict[str, Any], run_instant: datetime, run_id: str | None = None, nightly: bool = False
) -> dict[str, Any]:
    """Check every option and the rules across them; fix as_of_date (``run_instant``'s day in
    UTC; ``nightly``: a scheduled run, see :func:`jobs.run_type`). No database access."""
    p = jobs.given(DEFAULTS, params)
    errors: list[str] = []
    card_ids = parse_uuids("card_ids", p["card_ids"], errors)
    jobs.check_budget(p, errors)
    jobs.refuse(errors)
    instant = pendulum.instance(run_instant).in_timezone("UTC")
    opts = {
        **p,
        "card_ids": card_ids,
        "as_of_date": instant.date().isoformat(),
        "run_instant": instant.isoformat(),
        "run_tag": jobs.run_tag(),
        "nightly": nightly,
    }
    shown = ("as_of_date", "window_days", "half_life_days", "batch_size", "dry_run")
    named = " ".join(f"{k}={opts[k]}" for k in shown)
    log.info("run started: run=%s %s card_ids=%d", run_id, named, len(card_ids))
    return opts


def past_night(as_of: str | date, today: date) -> str | None:
    """Why a run of ``as_of`` may write no snapshot of that night (None: it may): the night
    is before yesterday by the job's clock. Its counters would be read today and stamped with
    that date, so the growth of every night since would land on it; tonight's run carries it
    (after a gap, the whole gap's growth lands on the first night after it)."""
    if date.fromisoformat(str(as_of)) >= today - timedelta(days=1):
        return None
    return f"night {as_of} is past; tonight's run carries its growth"


def check_as_of_date(opts: dict[str, Any]) -> None:
    """Refuse, before anything is written and whatever the run's type (scheduled, manual,
    backfill), a run dated after the job's clock (its snapshots would carry a future date,
    its retention would prune the real history, and every real night until then would write
    nothing) or before yesterday (:func:`past_night`). A run that passes and is cleared days
    later is caught at its writes (:func:`_backfill_guard`)."""
    today = jobs.today(JOB)
    if date.fromisoformat(opts["as_of_date"]) > today:
        raise JobConfigError(
            f"invalid options: as_of_date {opts['as_of_date']} (the run's logical date in UTC) "
            f"is after the database's current date {today.isoformat()}: a run may not be dated "
            "in the future; trigger it without a logical date (today) or with one up to today"
        )
    if why := past_night(opts["as_of_date"], today):
        raise JobConfigError(
            f"refused: {why} (yesterday is {today - timedelta(days=1)} by the database's clock "
            "in UTC); nothing was written"
        )


def _backfill_guard(cur, opts: dict[str, Any]) -> str | None:
    """Why this run may write nothing, or None: a newer date already has snapshots or a pass
    of a real run (a late clear of an older run, a backfill: history is never rewritten and
    newer scores never replaced by older ones), snapshots are dated after today, or the
    run's night has become past since it was checked (:func:`past_night`: a clear days
    later, a run that waited). Read at every write, with the job's clock."""
    cur.execute(sql("catalog/newest_snapshot"), {"job": JOB.code})
    g = fetch_one_dict(cur)
    as_of = date.fromisoformat(opts["as_of_date"])
    if g["newest_snapshot"] is not None and g["newest_snapshot"] > g["today"]:
        return (
            f"snapshots dated after today ({g['today']}) exist, up to {g['newest_snapshot']}: "
            "delete them (docs/runbook.md, Stuck states: snapshots dated in the future)"
        )
    if g["newest_pass"] is not None and g["newest_pass"] > as_of:
        return f"superseded by the run {g['newest_pass_run']} of {g['newest_pass']}"
    if g["newest_snapshot"] is not None and g["newest_snapshot"] > as_of:
        return f"as_of_date older than snapshots of {g['newest_snapshot']}"
    return past_night(as_of, g["today"])


def _spec(family: str, opts: dict[str, Any]) -> sweeps.SweepSpec:
    """The sweep of a pass: a real one may be resumed (its cards not reached go first the
    next night); a targeted repair or a dry run may not."""
    return sweeps.SweepSpec(
        job=JOB.code,
        family=family,
        as_of_date=opts["as_of_date"],
        targeted=bool(opts["card_ids"]),
        dry_run=opts["dry_run"],
        variant=formula_variant(opts),
        params={
            "as_of_date": opts["as_of_date"],
            "card_ids": len(opts["card_ids"]),
            "window_days": opts["window_days"],
            "half_life_days": opts["half_life_days"],
        },
    )


def pass_order(cur, opts: dict[str, Any]) -> list[str]:
    """The order of tonight's passes: property objects, then projects, unless the newest
    earlier night (of this formula) left a pass unfinished or never planned it. Then the passes
    behind go first, the one that ran last (or not at all) first: a night cut early (its
    budget, a graceful stop, a failure) never keeps cutting the same pass. Targeted repairs
    and dry runs keep the default order. It depends on earlier nights only, so every task and
    clear of tonight's run sees the same order."""
    order = [k.name for k in CARD_KINDS]
    if opts["card_ids"] or opts["dry_run"]:
        return order
    variant = formula_variant(opts)
    params = {"job": JOB.code, "as_of": opts["as_of_date"], "suffix": f" {variant}" * bool(variant)}
    cur.execute(sql("catalog/pass_order"), params)
    previous = {r["family"]: r for r in fetch_dicts(cur)}
    if not previous:
        return order
    behind = [k for k in order if k not in previous or previous[k]["status"] != "done"]
    behind.sort(key=lambda k: (k in previous, -previous[k]["sweep_id"] if k in previous else 0))
    return behind + [k for k in order if k not in behind]


def budget_share(cur, passes: list[str], source: dict[str, Any]) -> float:
    """The share of the run's time budget the first of ``passes`` (it and the passes after it,
    in tonight's order) may use: its cards over the cards of all of them, so that a pass that
    outgrows the budget never starves the passes after it (their share is theirs; what a pass
    leaves unused goes to the next). The last pass may use all that is left."""
    counts = []
    for later in passes:
        cur.execute(
            sql("common/keyset_count").replace("{source}", card_sql("source", later).strip()),
            source,
        )
        counts.append(int(cur.fetchone()[0]))
    total = sum(counts)
    return 1.0 if len(counts) == 1 or total == 0 else max(counts[0] / total, 0.05)


def formula_variant(opts: dict[str, Any]) -> str:
    """The formula parameters in a pass's identity ("" for the nightly's own): a run with
    another window or half-life never adopts the nightly's unfinished pass, nor it that run's,
    so one date's scores never mix two formulas."""
    w, h = opts["window_days"], opts["half_life_days"]
    if (w, h) == (DEFAULTS["window_days"], DEFAULTS["half_life_days"]):
        return ""
    return f"window {w}d half-life {h:g}d"


@dataclass
class Recompute(ranges.Worker):
    """The snapshot and rescore of one sweep's cards of ``kind`` (all of them, or the run's
    ``card_ids``): per batch, ``catalog/compute`` (no row lock), then ``catalog/apply`` (the
    batch's row locks and all its writes, one statement)."""

    kind: str
    taken: set[str] = field(default_factory=set)  # remembered cards the range took first
    dag_id = "catalog_popularity_recompute"
    job_code = "catalog-popularity-recompute"

    @property
    def writes(self) -> tuple[str, ...]:
        """The platform's table its batches write (pacing watches its vacuum). Not the job's
        own snapshot table: tonight's partition is vacuumed by autovacuum as the job's own
        inserts fill it, again and again through the night, and a VACUUM there slows no
        platform read; retention, whose DROP would wait for it, still paces on it."""
        return (KINDS[self.kind].table,)

    @property
    def span_attributes(self) -> dict[str, Any]:
        return {"card_kind": self.kind}  # the spec's name, on each batch span

    @property
    def item_kind(self) -> str:
        return self.kind

    @property
    def targeted(self) -> bool:
        return bool(self.opts["card_ids"])

    @property
    def source(self) -> dict[str, Any]:
        """The parameters of the kind's keyset source (``catalog/source``)."""
        return {"targeted": bool(self.opts["card_ids"]), "card_ids": self.opts["card_ids"]}

    def plan(self, cur, sweep: dict[str, Any]) -> tuple[int, list[str]]:  # noqa: ARG002
        partitions.ensure(cur, self.opts["as_of_date"])  # tonight's and the week after
        source_sql = card_sql("source", self.kind).strip()
        return sweeps.boundaries(
            cur, source_sql, self.source, self.opts["batch_size"], self.opts["max_ranges"]
        )

    def batch(self, cur, after_id, upper_id, limit: int) -> ranges.Batch:
        bounds = {"after_id": after_id, "upper_id": upper_id, "limit": limit, **self.source}
        rows = self._compute(cur, bounds)
        b = self._write(cur, [r for r in rows if r["id"] not in self.taken], limit)
        return replace(b, last_id=rows[-1]["id"] if rows else None, full=len(rows) >= limit)

    def remembered(self, cur, lower_id, upper_id) -> list[str]:
        if self.targeted or self.opts["dry_run"]:
            return []  # a targeted run writes its ids only; a dry run nothing
        bounds = {"lower_id": lower_id, "upper_id": upper_id, "limit": self.opts["batch_size"]}
        cur.execute(sql("catalog/remembered"), {"kind": self.kind, **bounds})
        return [r[0] for r in cur.fetchall()]

    def taken_first(self, ids: list[str]) -> None:
        self.taken.update(ids)

    def guard(self, cur) -> str | None:
        return _backfill_guard(cur, self.opts)

    def retry(self, cur, ids: list[str]) -> ranges.Batch:
        bounds = {"after_id": None, "upper_id": None, "limit": len(ids)}
        rows = self._compute(cur, {**bounds, "targeted": True, "card_ids": ids})
        if rows:  # wait for their locks (lock_timeout), then write as a batch does
            cur.execute(card_sql("lock", self.kind), {"ids": [r["id"] for r in rows]})
        return self._write(cur, rows, len(ids))

    @property
    def formula(self) -> dict[str, Any]:
        o = self.opts
        return {
            "kind": self.kind,
            "as_of": o["as_of_date"],
            "window_days": o["window_days"],
            "half_life": o["half_life_days"],
        }

    def _compute(self, cur, bounds: dict[str, Any]) -> list[dict[str, Any]]:
        """Statement 1, without any row lock: the next cards, their counters, and the score
        each gets with its counter as tonight's snapshot (docs/design.md says why no lock is
        needed)."""
        # the generic plan of this statement is ~20 % slower than a custom one, and
        # planning it is cheap next to executing it (bench/RESULTS.md)
        cur.execute(sql("common/custom_plans"))
        cur.execute(card_sql("compute", self.kind), {**bounds, **self.formula})
        return fetch_dicts(cur)

    def _write(self, cur, rows: list[dict[str, Any]], limit: int) -> ranges.Batch:
        """Statement 2 for the cards statement 1 read: write the values computed for them in
        one statement that locks them SKIP LOCKED after its snapshot upsert and before its score
        writes (card by card when one card makes it fail, see ranges.isolate_items); the cards
        it did not lock get their snapshot put back (``catalog/unapply``). The batch's row locks
        are held from there to the commit."""
        if not rows:
            return ranges.Batch(ranges.Counters())
        valid = {r["id"]: r for r in rows if r["views"] is not None and r["views"] >= 0}
        poison = [r for r in rows if r["id"] not in valid]
        for r in poison:
            self._failed(r["id"], f"popularity_views is {r['views']}; no snapshot and no score")
        out, failed = self._apply_all(cur, valid) if valid else ({}, [])
        for card_id in out.get("overflow_ids", []):
            self._failed(card_id, f"score does not fit numeric(12,4) (> {MAX_SCORE}); no score")
        locked = out.get("cards_locked", 0)
        counters = ranges.Counters(
            processed=locked + len(poison) + len(failed),
            changed=out.get("cards_updated", 0),
            written=locked,  # each card locked got its snapshot
            item_errors=len(poison) + len(failed) + len(out.get("overflow_ids", [])),
        )
        full = len(rows) >= limit
        skipped = out.get("skipped_ids", [])
        return ranges.Batch(counters, last_id=rows[-1]["id"], full=full, skipped_ids=skipped)

    def _failed(self, card_id: str, why: str) -> None:
        log.error("item failed: card_kind=%s card_id=%s: %s written", self.kind, card_id, why)

    def _apply_all(self, cur, valid: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], list]:
        """``catalog/apply`` for the ``valid`` cards (isolating the ones that make it fail;
        rolled back in a dry run): its summed results, and the ids that failed."""
        if self.opts["dry_run"]:
            cur.execute(sql("common/savepoint"))
        apply = functools.partial(self._apply, cur, valid)
        parts, failed = ranges.isolate_items(cur, list(valid), apply, self.record, "card_id")
        out: dict[str, Any] = {"cards_updated": 0, "cards_locked": 0}
        out.update(overflow_ids=[], skipped_ids=[])
        for part in parts:
            for k, v in out.items():
                out[k] = v + (part[k] if isinstance(v, list) else int(part[k]))
        if self.opts["dry_run"]:
            cur.execute(sql("common/rollback_to_savepoint"))
        return out, failed

    def _apply(self, cur, valid: dict[str, dict[str, Any]], ids: list[str]) -> list[dict]:
        """``catalog/apply`` for the cards ``ids``; the snapshots of those it did not lock are
        put back as they were (``catalog/unapply``)."""
        at = {"kind": self.kind, "as_of": self.opts["as_of_date"]}
        cur.execute(
            card_sql("apply", self.kind),
            {**at, "ids": ids, **{k: [valid[i][c] for i in ids] for k, c in APPLIED}},
        )
        res = fetch_dicts(cur)
        r = res[0]
        if r["undo_ids"]:  # the cards not locked keep no snapshot of tonight
            undo = {"ids": r["undo_ids"], "views": r["undo_views"], "created": r["undo_created"]}
            cur.execute(card_sql("unapply", self.kind), {**undo, **at})
        return res


def make_batch(kind: str, opts: dict[str, Any], sweep_id: int, run_id: str) -> Recompute:
    """The recompute of the ranges of sweep ``sweep_id`` (what a range task runs)."""
    return Recompute(opts, sweep_id, run_id, kind)


def retention_days(opts: dict[str, Any]) -> int:
    """Days of history retention keeps (plus 2): never fewer than the nightly window needs, so
    that a manual run with a smaller ``window_days`` cannot prune what tomorrow's scheduled run
    reads; a run with a larger window keeps its own."""
    return max(opts["window_days"], DEFAULTS["window_days"])


def retention(run: runs.Run) -> int:
    """Drop the partitions of snapshots no window reads any more, one a transaction, pacing
    on the database's health before each (as a range does) and stopping at the run's
    deadline: what is left is pruned by the next run (:func:`partitions.prune`)."""
    opts = run.opts
    if run.lease is None or opts["card_ids"]:
        log.info("retention skipped (%s)", "targeted run" if opts["card_ids"] else LOCK_HELD)
        return 0
    with run.connect() as conn:
        lease = leases.rejoin(conn, run.held())
    keep = retention_days(opts)
    params = {"as_of": opts["as_of_date"], "keep_days": keep}
    with connection(JOB.conn_id) as conn:
        with transaction(conn) as cur:
            why = _backfill_guard(cur, opts)
            if why is None and opts["dry_run"]:
                pruned = partitions.would_prune(cur, opts["as_of_date"], keep)
        if why is not None:
            log.warning("retention skipped: %s", why)
            return 0
        if not opts["dry_run"]:
            pruned = partitions.prune(conn, lease, opts, keep)
            with transaction(conn) as cur:
                for name in ("prune_inherited", "prune_skipped"):
                    cur.execute(sql(f"catalog/{name}"), params)
    log.info(
        "retention: %d snapshot(s) older than %s - %d days %s",
        pruned,
        opts["as_of_date"],
        keep + 2,
        "would be pruned (dry run)" if opts["dry_run"] else "pruned",
    )
    return pruned
