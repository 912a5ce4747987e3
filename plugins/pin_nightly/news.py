"""news_comment_reconcile: recount ``news.posts.comments_count`` from the visible comments.

Each batch is one transaction: read the range's next posts and check their counters against
their visible comments; lock the posts that look drifted ``FOR NO KEY UPDATE SKIP LOCKED``;
recount those in a second statement (its snapshot is taken after the locks are held), correct the
ones that are drifted and record each correction; advance the range cursor.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pendulum
from airflow.sdk import Asset, Param

from pin_nightly import jobs, metrics, ranges, runs, sweeps
from pin_nightly.db import fetch_dicts, fetch_one_dict, sql, transaction
from pin_nightly.jobs import parse_uuids

log = logging.getLogger(__name__)

TZ = "Europe/Moscow"
METRIC = "news_comment_reconcile"
# A window reaches back this far before the start of the last completed sweep, to cover
# transactions that were in flight when it started.
WINDOW_MARGIN = timedelta(hours=1)
SCOPES = ("auto", "DailyWindow", "FullSweep")


class News(jobs.Job):
    """The reconcile's part of a run (see :class:`jobs.Job`)."""

    def tonight(self, conn, run: runs.Run, part: str | None) -> runs.Pass:  # noqa: ARG002
        scope = run.opts["effective_scope"]
        worker = Reconcile(run.opts, None, run.run_id, candidate_mode=scope != "FullSweep")
        return runs.Pass(sweep_spec(run.opts), worker, scope)

    def worker(self, run: runs.Run, rng: dict[str, Any]) -> Reconcile:
        full = rng["family"] == "FullSweep"
        return make_batch(run.opts, rng["sweep_id"], run.run_id, candidate_mode=not full)

    def result(self, run: runs.Run, **given: Any) -> dict[str, Any]:  # noqa: ARG002
        return {
            "scope": run.opts["effective_scope"],
            "posts_reconciled": 0,
            "drift_corrected": 0,
            "drift_found": 0,
            "batches_processed": 0,
            "last_post_id": None,
            "posts_skipped_locked": 0,
            "sweep_id": None,
            "sweeps": [],
        }

    def count(self, run: runs.Run, totals, result: dict[str, Any]) -> None:
        own = sweep_spec(run.opts).scope
        for t in totals:
            if t["scope"] == own:
                result["sweep_id"] = t["sweep_id"]
            c = t["counters"]
            sweep = {k: t[k] for k in ("sweep_id", "scope", "sweep_status")}
            result["sweeps"].append(
                {**sweep, "rows_processed": c.processed, "rows_changed": c.changed}
            )
            ids = [result["last_post_id"], t["last_id"]]
            result["last_post_id"] = max(filter(None, ids), default=None)
        total = sum((t["counters"] for t in totals), ranges.Counters())
        result.update(
            posts_reconciled=total.processed,
            drift_found=total.changed,
            batches_processed=total.batches,
            posts_skipped_locked=total.skipped_locked,
            item_errors=total.item_errors,
        )
        # a dry run finds drift and corrects none
        result["drift_corrected"] = 0 if run.dry_run else total.changed

    def settle(self, conn, run: runs.Run, result: dict[str, Any]) -> None:  # noqa: ARG002
        """Forget what no run needs any more: window candidates of finished sweeps, and skipped
        posts that a completed sweep has covered since."""
        with transaction(conn) as cur:
            cur.execute(sql("news/prune_candidates"), {"job": JOB.code, "owner": run.holder})
            if cur.rowcount:
                log.info("deleted %d window candidates of finished sweeps", cur.rowcount)
            cur.execute(sql("news/prune_skipped"), {"job": JOB.code})
            if cur.rowcount:
                log.info(
                    "forgot %d skipped posts that a completed sweep covered since", cur.rowcount
                )

    def options(self, params, instant, run_id, nightly: bool) -> dict[str, Any]:  # noqa: ARG002
        return validate_options(params, instant, nightly)

    def asset_extra(self, result: dict[str, Any]) -> dict[str, Any] | None:
        """The extra of the asset event of a run that completed its sweep, or None: a dry run, a
        targeted repair, a run that found the lease held or left work unfinished publish nothing."""
        if result["status"] != "success" or result["dry_run"] or result["scope"] == "Targeted":
            return None
        return {
            "scope": result["scope"],
            "posts_reconciled": result["posts_reconciled"],
            "drift_corrected": result["drift_corrected"],
            "run_id": result["run_id"],
        }

    def rows_tried(self, result: dict[str, Any]) -> int:
        return result["posts_reconciled"] + result["item_errors"]

    def work_done(self, result: dict[str, Any]) -> int:
        return int(result.get("drift_corrected") or 0)

    def signals(self, run: runs.Run, result, cur, window, nightly: bool) -> runs.Signals:
        """What the run's first summary sends. The drift figures come from the corrections
        recorded in ``pin_nightly.news_drift``, not from the run's counters: a correction made by a
        run that died before its summary is counted by the next one. The gauges that the alert
        rules compare describe the nightly work: only a nightly run sets them, with the drift
        corrected since the previous nightly summary."""
        keys = ("since_any", "since_nightly", "through", "acquired_at")
        cur.execute(sql("news/drift_counted"), {k: getattr(window, k) for k in keys})
        counted = fetch_one_dict(cur)
        threshold = run.opts["drift_alert_threshold"]
        signals = runs.Signals(
            counters=[
                [f"{METRIC}_drift_corrected_total", counted["corrected"], None],
                *_by_direction(f"{METRIC}_drift_total", counted, "corrected"),
            ],
            run_totals=[
                [f"{METRIC}_posts_reconciled_total", result["posts_reconciled"], None],
                # posts a batch could not write (pin_nightly.item_error); failed tasks count apart
                [f"{METRIC}_errors_total", result["item_errors"], None],
            ],
            timings=[[f"{METRIC}_run_duration_ms", result["duration_ms"], None]],
        )
        if nightly:
            drift, since = counted["nightly"], "since the previous nightly run's summary"
            signals.gauges += _nightly_gauges(result, counted, threshold)
        else:
            drift, since = counted["own"], "in this run"
        # success means the nightly work was done: not a targeted repair, nothing left behind
        if result["status"] == "success" and result["scope"] != "Targeted":
            done = window.work_done_at.timestamp()
            signals.gauges.append([f"{METRIC}_last_success_timestamp_seconds", done, None])
        if window.current and drift > threshold:
            signals.alert = {"drift_corrected": drift, "threshold": threshold, "counted": since}
        return signals

    def emit_state(self, conn) -> None:
        """The gauges of what the job has covered, from the database: when the newest FullSweep and
        DailyWindow completed. Sent by the summary and again by the teardown, which runs when the
        summary failed."""
        runs.close_finished(conn, JOB.code)
        with transaction(conn) as cur:
            cur.execute(sql("common/sweeps_last_completed"), {"job": JOB.code})
            completed = dict(cur.fetchall())
        if "FullSweep" in completed:
            metrics.gauge(f"{METRIC}_last_full_sweep_timestamp_seconds", completed["FullSweep"])
        if "DailyWindow" in completed:
            metrics.gauge(f"{METRIC}_last_daily_window_timestamp_seconds", completed["DailyWindow"])

    def alert(self, run: runs.Run, alert: dict[str, Any]) -> None:
        from pin_nightly import alerts

        alerts.drift_alert(self.dag_id, run.run_id, **alert)


_MAX_LOOKBACK_HOURS = 366 * 24  # larger overflows Python's datetimes

# The DAG's params: each option's type, default, bounds and description, defined once. Airflow
# checks them when a run is created (a bad value creates no run); validate_options checks the
# rules across options.
PARAMS = {
    "scope": Param(
        "auto",
        enum=list(SCOPES),
        description="auto (FullSweep on nights matching full_sweep_cron in Europe/Moscow, "
        "a manual run before noon of that day; else DailyWindow), DailyWindow or FullSweep",
    ),
    "full_sweep_cron": Param(
        "0 3 * * 0",
        type="string",
        description="A 5-field cron expression, read in Europe/Moscow: the nights on which "
        "auto means FullSweep (default: Sundays)",
    ),
    "batch_size": Param(
        2000,
        type="integer",
        minimum=1,
        maximum=jobs.MAX_BATCH,
        description=f"Posts checked per batch, an integer from 1 to {jobs.MAX_BATCH}; only those "
        "that look drifted are locked (the spec's 500 is 1.6x slower, see bench/RESULTS.md "
        "Design choices)",
    ),
    "window_lookback_hours": Param(
        26,
        type="number",
        exclusiveMinimum=0,
        maximum=_MAX_LOOKBACK_HOURS,
        description=f"DailyWindow: minimal look-back in hours, more than 0 and at most "
        f"{_MAX_LOOKBACK_HOURS}",
    ),
    "drift_alert_threshold": Param(
        1000,
        type="integer",
        minimum=0,
        description="Alert when a run corrects more posts than this (an integer >= 0)",
    ),
    **jobs.common_params(
        20,
        30,
        "post_ids",
        "Targeted repair of just these posts: one uuid per line, e.g. "
        "0190a000-0000-7000-8000-000000000000; leave scope at auto",
        "Report drift, write nothing",
    ),
    "drift_retention_days": jobs.retention_param("drift records (pin_nightly.news_drift)"),
}
DEFAULTS: dict[str, Any] = jobs.defaults(PARAMS)


# Published when a run completed its sweep: other teams' DAGs schedule on it by this name.
COUNTS_ASSET = Asset("news_comment_counts")

JOB = News(
    code="news-comment-reconcile",
    dag_id="news_comment_reconcile",
    conn_id="news_db",
    domain_columns={
        "news.posts": ["id", "status", "comments_count", "updated_at"],
        "news.comments": ["id", "post_id", "status", "created_at", "updated_at"],
    },
    owned_ddl=[jobs.STATE_DDL],
    recommended_indexes=[
        ("news.comments", "(post_id) WHERE (status = 'Visible'", "ix_comments_post_id_visible"),
        ("news.comments", "(updated_at)", "ix_comments_updated_at"),
    ],
    history=(*jobs.Job.history, ("drift_retention_days", "news/prune_drift")),
    headline="%(scope)s, %(posts_reconciled)s posts checked, %(drift_corrected)s corrected, "
    "%(item_errors)s failed",
    completed="job completed: posts_reconciled=%(posts_reconciled)s "
    "drift_corrected=%(drift_corrected)s drift_found=%(drift_found)s "
    "batches=%(batches_processed)s "
    "backlog_remaining=%(backlog_remaining)s duration_ms=%(duration_ms)s "
    "skipped_locked=%(posts_skipped_locked)s item_errors=%(item_errors)s "
    "scope=%(scope)s dry_run=%(dry_run)s "
    "status=%(status)s unfinished_sweeps=%(unfinished_sweeps)s",
    params=PARAMS,
    schedule=("0 3 * * *", TZ),
    owner="PIN Engagement",
    description="Nightly recount of news.posts.comments_count from visible comments, at 03:00 "
    "Europe/Moscow (00:00 UTC, as the UI shows it)",
    tag="news",
    asset=COUNTS_ASSET,
    ids_param="post_ids",
    writes=("news.posts",),
    work_label="corrections",
    whole_family="FullSweep",
)


def cron_fires_on_day(cron: str, instant: datetime, tz: str) -> bool:
    """Whether ``cron`` (read in ``tz``) fires on the calendar day of ``instant`` in ``tz``."""
    from croniter import croniter

    local = pendulum.instance(instant).in_timezone(tz)
    day_start = local.start_of("day")
    nxt = croniter(cron, day_start.subtract(seconds=1)).get_next(datetime)
    return pendulum.instance(nxt, tz=tz) < day_start.add(days=1)


def validate_options(
    params: dict[str, Any], run_instant: datetime, nightly: bool = False
) -> dict[str, Any]:
    """Check every option and the rules across them; resolve the scope for the run about
    ``run_instant`` (``nightly``: a scheduled run, see :func:`jobs.run_type`). No database
    access."""
    from croniter import croniter

    p = jobs.given(DEFAULTS, params)
    errors: list[str] = []
    if not croniter.is_valid(p["full_sweep_cron"]):
        errors.append(f"full_sweep_cron is not a valid cron expression: {p['full_sweep_cron']!r}")
    post_ids = parse_uuids("post_ids", p["post_ids"], errors)
    jobs.check_budget(p, errors)
    if post_ids and p["scope"] != "auto":
        errors.append(
            f"post_ids asks for a targeted repair; leave scope at 'auto' (got {p['scope']!r})"
        )
    jobs.refuse(errors)
    scope = _effective_scope(p, post_ids, run_instant, nightly)
    opts = {
        **p,
        "post_ids": post_ids,
        "effective_scope": scope,
        "run_instant": pendulum.instance(run_instant).in_timezone(TZ).isoformat(),
        "run_tag": jobs.run_tag(),
        "nightly": nightly,
    }
    named = " ".join(f"{k}={p[k]}" for k in ("batch_size", "max_run_duration_minutes", "dry_run"))
    log.info("options: scope=%s (asked %s) %s post_ids=%d", scope, p["scope"], named, len(post_ids))
    return opts


# A manual ``auto`` run is about the night until this hour (Europe/Moscow) of the day
# ``full_sweep_cron`` fires on; later that day it is a DailyWindow.
NIGHT_ENDS_HOUR = 12


def _effective_scope(
    p: dict[str, Any], post_ids: list[str], instant: datetime, nightly: bool = False
) -> str:
    """The run's scope: Targeted for given posts; auto is FullSweep on the nights that
    ``full_sweep_cron`` fires on in Europe/Moscow (a manual run: before noon of that day),
    else DailyWindow."""
    if post_ids:
        return "Targeted"
    if p["scope"] != "auto":
        return p["scope"]
    night = nightly or pendulum.instance(instant).in_timezone(TZ).hour < NIGHT_ENDS_HOUR
    full = night and cron_fires_on_day(p["full_sweep_cron"], instant, TZ)
    return "FullSweep" if full else "DailyWindow"


def _window_cutoff(cur, opts: dict[str, Any]) -> datetime:
    now = datetime.now(UTC)
    cutoff = now - timedelta(hours=opts["window_lookback_hours"])
    cur.execute(sql("news/window_cutoff"), {"job": JOB.code})
    covered = cur.fetchone()[0]
    if covered is not None and covered - WINDOW_MARGIN < cutoff:
        log.info("last completed sweep started %s: window reaches back to it", covered)
        cutoff = covered - WINDOW_MARGIN
    return cutoff


def sweep_spec(opts: dict[str, Any]) -> sweeps.SweepSpec:
    """The run's own sweep. The scopes share one keyset (the posts): a real run (not
    targeted, not dry) may be resumed by a later run, and also resumes every unfinished sweep
    of the other scope (a FullSweep stopped by its time budget is not parked until the next
    FullSweep night): its own sweep first, then the older ones, all within the run's one time
    budget; a DailyWindow replaces an unfinished one. Targeted repairs and dry runs do only
    their own work."""
    scope = opts["effective_scope"]
    window = scope == "DailyWindow"
    return sweeps.SweepSpec(
        job=JOB.code,
        family=scope,
        targeted=scope == "Targeted",
        dry_run=opts["dry_run"],
        precedence=sweeps.Precedence.REPLACES if window else sweeps.Precedence.JOB,
        params={"batch_size": opts["batch_size"], "post_ids": len(opts["post_ids"])},
    )


@dataclass
class Reconcile(ranges.Worker):
    """The reconcile of one sweep's posts: every post of the scope (FullSweep), or the sweep's
    candidates (``candidate_mode``: a DailyWindow's, a targeted repair's)."""

    candidate_mode: bool
    dag_id = "news_comment_reconcile"
    job_code = "news-comment-reconcile"
    writes = JOB.writes  # pacing watches their vacuum

    @property
    def targeted(self) -> bool:
        return self.opts["effective_scope"] == "Targeted"

    def plan(self, cur, sweep: dict[str, Any]) -> tuple[int, list[str]]:
        """Collect a DailyWindow's or a targeted repair's candidates; split the posts."""
        o, sweep_id = self.opts, {"sweep_id": sweep["sweep_id"]}
        if o["effective_scope"] == "DailyWindow":
            cutoff = _window_cutoff(cur, o)
            cur.execute(
                sql("news/window_candidates"), {**sweep_id, "cutoff": cutoff, "job": JOB.code}
            )
            log.info(
                "DailyWindow: %d candidate posts with comment activity since %s",
                cur.rowcount,
                cutoff,
            )
            params = json.dumps({"cutoff": cutoff.isoformat()})
            cur.execute(sql("common/sweep_set_params"), {**sweep_id, "params": params})
        elif o["effective_scope"] == "Targeted":
            cur.execute(sql("news/targeted_candidates"), {**sweep_id, "post_ids": o["post_ids"]})
        if self.candidate_mode:
            cur.execute(sql("news/analyze_candidates"))
        source = sql("news/candidate_source" if self.candidate_mode else "news/full_source")
        return sweeps.boundaries(cur, source.strip(), sweep_id, o["batch_size"], o["max_ranges"])

    def batch(self, cur, after_id, upper_id, limit: int) -> ranges.Batch:
        cur.execute(
            sql("news/candidate_lock" if self.candidate_mode else "news/full_lock"),
            {"sweep_id": self.sweep_id, "after_id": after_id, "upper_id": upper_id, "limit": limit},
        )
        return self._reconcile(cur, limit)

    def retry(self, cur, ids: list[str]) -> ranges.Batch:
        cur.execute(sql("news/ids_lock"), {"ids": ids})
        return self._reconcile(cur, 1)

    def _reconcile(self, cur, limit: int) -> ranges.Batch:
        """Recount the posts the lock statement just locked; correct and record the drifted."""
        got = fetch_one_dict(cur)
        if not got["n_read"]:
            return ranges.Batch(ranges.Counters())
        locked = list(got["locked_ids"])
        held = set(locked)
        skipped = [i for i in got["suspect_ids"] if i not in held]
        drift, failed, dry_run = [], [], self.opts["dry_run"]
        if locked:

            def apply(ids: list[str]) -> list[dict[str, Any]]:
                params = {"ids": ids, "dry_run": dry_run, "sweep_id": self.sweep_id}
                cur.execute(sql("news/apply"), {**params, "run_id": self.run_id})
                return fetch_dicts(cur)

            drift, failed = ranges.isolate_items(cur, locked, apply, self.record, "post_id")
        if skipped and not dry_run:
            cur.execute(sql("news/skipped_record"), {"ids": skipped})
        for d in drift:
            what = "found" if dry_run else "corrected"
            log.debug("drift %s: post %s %s -> %s", what, d["id"], d["count_from"], d["count_to"])
        # reconciled: every eligible post read, except those left locked by someone else
        processed = got["n_eligible"] - len(skipped) - len(failed)
        return ranges.Batch(
            ranges.Counters(processed=processed, changed=len(drift), item_errors=len(failed)),
            last_id=got["last_id"],
            full=got["n_read"] >= limit,
            skipped_ids=skipped,
        )


def make_batch(opts: dict[str, Any], sweep_id: int, run_id: str, candidate_mode: bool) -> Reconcile:
    """The reconcile of the ranges of sweep ``sweep_id`` (what a range task runs)."""
    return Reconcile(opts, sweep_id, run_id, candidate_mode)


def _nightly_gauges(result: dict[str, Any], counted: dict[str, int], threshold: int) -> list:
    """The gauges that describe the nightly work, which the alert rules compare: the night's
    corrections (``counted`` by ``news/drift_counted``), in all and by direction."""
    return [
        [f"{METRIC}_posts_skipped_locked", result["posts_skipped_locked"], None],
        [f"{METRIC}_last_run_drift_corrected", counted["nightly"], None],
        *_by_direction(f"{METRIC}_last_run_drift", counted, "nightly"),
        # the nightly's threshold, so that the rule compares with it, not a copied number
        [f"{METRIC}_drift_alert_threshold", threshold, None],
    ]


# The sign of a correction: up, the stored count was too low (the hot path lost increments);
# down, it was too high (the hot path counted a comment twice).
DIRECTIONS = ("up", "down")


def _by_direction(name: str, counted: dict[str, int], window: str) -> list:
    """The metric ``name`` once per direction, from the ``<window>_<direction>`` counts."""
    return [[name, counted[f"{window}_{d}"], {"direction": d}] for d in DIRECTIONS]
