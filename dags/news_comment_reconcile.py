"""
# news_comment_reconcile

Recounts `news.posts.comments_count` from the `Visible` comments and corrects the drift the
hot path (INV-CMT-005) leaves behind. Nightly at 03:00 Europe/Moscow: a **DailyWindow** over
posts whose comments changed since the last completed sweep (at least `window_lookback_hours`
back), or a **FullSweep** of every non-archived post on nights matching `full_sweep_cron`
(Sundays by default). Only `comments_count` and `updated_at` of drifted posts are written.

**Safe to re-run?** Yes. The recount is absolute; a second run on the same data corrects 0.
Progress lives in PostgreSQL (`pin_nightly.sweep_range` cursors): clearing a failed task (on
its own, with "only failed", or the whole run) resumes each range from its cursor. A sweep left
unfinished (time budget, a lost worker, a summary that never ran) is finished by the next run
of either scope, after its own work; until then every run says `status: backlog_remaining`
and names it in `unfinished_sweeps`. `success` means nothing is left behind.

**When it fails**
- `validate_options` failed: the message names the bad option; trigger again with a fixed conf.
  An Airflow backfill of days before yesterday is refused there: a run sweeps today's rows
  whatever its date, and the next DailyWindow reaches back to the last completed sweep.
- summary `status: skipped, lock held` (and that line in `acquire_lease`'s log): another run
  (maybe another deployment firing the same slot: the holder `<dag>/<run_id> ~<tag>` names
  the acquisition) holds `Pin:lock:job:scheduled:news-comment-reconcile`; the run did
  nothing and succeeded. The lease expires by its TTL (`pin_nightly.job_lease` shows the holder).
- a `reconcile_range` failed: read its log, fix the cause (database down, lease lost, a session
  timeout: docs/schema.md "Session bounds"), then clear that task instance: it resumes from
  its cursor
  (cleared while its sibling ranges still run, its setup re-joins the run's lease as it is:
  the siblings go on and the run's budget does not start again).
  Airflow 3.3.2 answers a clear made before the run's budget (the lease TTL) has passed
  with HTTP 500: docs/design.md, Development notes.
  Cleared after a later run adopted its range, it writes nothing and says `superseded by the
  run ...` (green).
- `pausing: <signal>=<value> over <limit>` in a range's log: the database was unhealthy and the
  batches waited (docs/operations.md "Pacing on the database's health"); a run whose budget
  ran out paused ends `backlog_remaining`, and the next run resumes.
- `item_errors` > 0: a post could not be written (a trigger or constraint rejected it); the
  others were, the range went on. `pin_nightly.item_error` has the post and its error.
- drift alert (a nightly run: corrections since the previous nightly summary above
  `drift_alert_threshold`; a manual run: its own): a bug in the hot-path increment; the job
  treats the symptom. `pin_nightly.news_drift` lists every correction.
- backlog not draining (`backlog_remaining` night after night, no completed FullSweep for 8
  days): raise `max_run_duration_minutes` (and `lock_ttl_minutes`), add pool slots, look for
  long-held row locks.

**Downstream**: `publish` updates the asset `news_comment_counts` when the run completed its
sweep; it is skipped (no event) for dry, targeted, skipped or unfinished runs.

Targeted repair: trigger with `{"post_ids": ["<uuid>", ...]}`; try `{"dry_run": true}` first.
Full runbook: docs/runbook.md.

The logic lives in `plugins/pin_nightly/news.py`; SQL in `include/sql/news/`.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG, CronTriggerTimetable, get_current_context, setup, task, teardown

from pin_nightly import jobs, news, runs

POOL = "news_comment_reconcile"


with DAG(
    description="Nightly recount of news.posts.comments_count from visible comments, at 03:00 "
    "Europe/Moscow (00:00 UTC, as the UI shows it)",
    schedule=CronTriggerTimetable("0 3 * * *", timezone="Europe/Moscow"),
    start_date=pendulum.datetime(2026, 1, 1, tz="Europe/Moscow"),
    doc_md=__doc__,  # the runbook in the UI: this module's docstring
    tags=["pin-nightly", "news"],
    # one run at a time, params, deadline alerts (SLA), failed attempts counted, retries
    **jobs.dag_settings(news.JOB, news.PARAMS, owner="PIN Engagement"),
) as dag:

    @task(pool=POOL)
    @jobs.config_errors_fail
    def validate_options(params=None, logical_date=None, dag_run=None) -> dict:
        instant = jobs.run_instant(logical_date, dag_run.run_after)
        params, settings = jobs.deployment_settings(news.JOB, news.PARAMS, params, dag_run.conf)
        opts = news.validate_options(params, instant, jobs.is_nightly(dag_run.run_type))
        opts["settings"] = settings
        backfill = jobs.is_backfill(dag_run.run_type)
        jobs.check_backfill(news.JOB, instant.date().isoformat(), backfill, False)
        return opts

    @setup
    @task(pool=POOL)
    @jobs.config_errors_fail
    def acquire_lease(opts: dict, run_id=None) -> dict:
        return jobs.acquire_lease(news.JOB, opts, run_id)

    @task(pool=POOL)
    def plan_ranges(opts: dict, lease: dict, run_id=None) -> list[dict]:
        return runs.plan(runs.Run.of(news.JOB, opts, run_id, lease))

    @task(pool=POOL, map_index_template="{{ range_label }}")
    def reconcile_range(rng: dict, opts: dict, lease: dict, run_id=None) -> dict:
        get_current_context()["range_label"] = rng["label"]
        return runs.work_range(runs.Run.of(news.JOB, opts, run_id, lease), rng)

    # The lease is pulled here rather than passed: a task right after the setup task must have
    # the trigger rule all_success, and the summary must also run after ranges that skipped.
    @task(pool=POOL, trigger_rule="none_failed")
    def summarize(opts: dict, run_id=None, ti=None) -> dict:
        lease = ti.xcom_pull(task_ids="acquire_lease")
        return runs.summarize(runs.Run.of(news.JOB, opts, run_id, lease))

    @teardown
    @task(pool=POOL)
    def release_lease(lease: dict | None, run_id=None) -> bool:
        return runs.teardown(runs.Run.of(news.JOB, {}, run_id, lease))  # needs the lease only

    # An asset event when the run completed its sweep (skipped, no event, otherwise)
    @task(pool=POOL, outlets=[news.COUNTS_ASSET])
    def publish(summary: dict, outlet_events=None) -> dict:
        return jobs.publish(news.COUNTS_ASSET, news.asset_extra(summary), outlet_events)

    opts = validate_options()
    lease = acquire_lease(opts)
    ranges = plan_ranges(opts, lease)
    done = reconcile_range.partial(opts=opts, lease=lease).expand(rng=ranges)
    summary = summarize(opts)
    done >> summary >> release_lease(lease)
    publish(summary)
