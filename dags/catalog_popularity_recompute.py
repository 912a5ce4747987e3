"""
# catalog_popularity_recompute

Nightly at 03:00 UTC: for every card that is not `Delisted` (property objects first, then
projects) snapshot the cumulative counter `popularity_views` into
`catalog.popularity_daily_views` (one row per card and `as_of_date`) and recompute
`popularity_score` = sum of the daily deltas of the last `window_days` days, each weighted by
2^(-age / `half_life_days`), rounded to 4 places; a day's growth is measured from the card's
previous snapshot up to `window_days + 2` days back. Snapshots older than
`max(window_days, 30) + 2` days are pruned at the end, a night's partition a transaction,
pacing like the batches (a manual run with a small window never prunes what the nightly run
needs; a run at its deadline leaves the rest to the next). `as_of_date` is the run's logical
date in UTC (manual runs: the day they were triggered); a date after the job's clock (the
database's current date) is refused, and so is a night before yesterday, whatever the run's
type: its snapshots would be today's counters (docs/design.md; tests run a night "as of" its
date: docs/development.md).

**Safe to re-run?** Yes. Snapshots are upserted by (card, date) and the score is a pure
function of the stored snapshots: re-running a date changes nothing (unless the counters moved
since). A run whose `as_of_date` is older than the newest snapshot (or than a newer run's pass)
writes nothing. A catch-up of missed nights (a backfill, a manual run with an old logical
date) fails `validate_options` before writing: `night D is past; tonight's run carries its
growth`, and tonight's run puts the whole gap's growth on tonight. Clearing a failed
`recompute_*` task resumes its range from its cursor; cleared after a newer night ran (or
planned a pass), it writes nothing and says `superseded by the run ... of <date>`, and
cleared once its night is before yesterday it writes nothing and says `night D is past`. A
run with another `window_days` / `half_life_days` works passes of its own, never the
nightly's, and leaves the nightly's coverage order alone.

**When it fails**
- `validate_options` failed: the message names the bad option; trigger again with a fixed conf.
  `night D is past`: nothing to do, tonight's run carries that night's growth.
- summary `status: skipped, lock held`: another run holds
  `Pin:lock:job:scheduled:catalog-popularity-recompute` (see `pin_nightly.job_lease`).
- a `recompute_*` range failed (database down, lease lost, a session timeout:
  docs/schema.md "Session bounds"): the batch in flight was rolled back
  and the passes after it wait; fix the cause and clear that task instance with its downstream
  tasks (it resumes from its cursor; cleared while its sibling ranges still run, its setup
  re-joins the run's lease as it is: the siblings go on and the run's budget does not start
  again), or let the next night recompute (a newer date supersedes the unfinished pass).
  Airflow 3.3.2 answers a clear made before the run's budget (the lease TTL) has passed
  with HTTP 500: docs/design.md, Development notes.
  `status: success` means both passes completed and nothing is left; `scores_as_of_date` is
  the newest date whose two passes completed. Retention and the summary run all the same;
  the summary's `tasks failed: N task(s) of the run failed` makes the run red.
- `pausing: <signal>=<value> over <limit>` in a range's (or `retention`'s) log: the database
  was unhealthy and the batches waited (docs/operations.md "Pacing on the database's
  health"); a run whose budget ran out paused ends `backlog_remaining`, and the next run resumes.
- `item_errors` > 0: poison cards (NULL or negative `popularity_views`, a score too large for
  numeric(12,4), an update a trigger or constraint rejects: `pin_nightly.item_error`); the log
  lists `card_kind` and `card_id` at ERROR. Fix the data; the next run picks them up (a card
  that failed before and is unchanged is tried again each night, apart from the others, and
  written as soon as what rejected it is gone).
- `nothing written: snapshots dated after today`: delete those rows (docs/runbook.md, Stuck
  states).
- scores stale (`scores_as_of_date` more than 30 h old): no run completed both passes lately.
- a night cut early (budget, graceful stop, failure): the next night's pass starts with the
  cards it did not reach, in every range; when a pass was left unfinished the passes swap for
  the next night (`recompute_property_objects` then works `Project#…` ranges). Past the
  deadline retention still deletes the oldest night past the horizon.

**Downstream**: `publish` updates the asset `catalog_popularity_scores` when the run completed
both passes of its `as_of_date`; it is skipped (no event) for dry, targeted, skipped or
unfinished runs.

Targeted recompute: trigger with `{"card_ids": ["<uuid>", ...]}`; try `{"dry_run": true}` first.
Full runbook: docs/runbook.md.

The logic lives in `plugins/pin_nightly/catalog.py`; SQL in `include/sql/catalog/`.
"""

from __future__ import annotations

from pin_nightly import catalog, tasks

# Its tasks, their pool and the run's shape: plugins/pin_nightly/tasks.py (the same for both
# jobs); its schedule, owner and passes: catalog.JOB
dag = tasks.job_dag(catalog.JOB, doc_md=__doc__)  # the runbook in the UI: this module's docstring
