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
  run ...` (green). Whatever became of the ranges, the summary runs: it logs what the run
  did and, with `tasks failed: N task(s) of the run failed`, makes the run red.
- `pausing: <signal>=<value> over <limit>` in a range's log: the database was unhealthy and the
  batches waited (docs/operations.md "Pacing on the database's health"); a run whose budget
  ran out paused ends `backlog_remaining`, and the next run resumes.
- `item_errors` > 0: a post could not be written (a trigger, a constraint or a row-level
  security policy rejected it); the others were, the range went on. `pin_nightly.item_error`
  has the post and its error; the post stays a DailyWindow candidate every night until it is
  written.
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

from pin_nightly import news, tasks

# Its tasks, their pool and the run's shape: plugins/pin_nightly/tasks.py (the same for both
# jobs); its schedule, owner and passes: news.JOB
dag = tasks.job_dag(news.JOB, doc_md=__doc__)  # the runbook in the UI: this module's docstring
