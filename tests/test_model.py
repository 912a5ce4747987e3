"""A model-based test of the operations a data team and the platform perform, in any order.

Hypothesis (``RuleBasedStateMachine``) draws sequences of operations, each one real: a DAG run
through Airflow (``dag.test()``) on a real PostgreSQL, a clear of a failed run, traffic on the
domain tables (between runs and during a run's batches), a domain trigger rejecting rows, a
run's budget cut short. After every step the invariants are checked on the database, never on
the runs' counters. The rules and invariants are described in docs/reliability.md ("The
model").

Profiles: ``make test`` runs the bounded one: the covering sequences below
(:data:`NEWS_SEQUENCES`, :data:`CATALOG_SEQUENCES`), driven through the same machine, the same
every time; every value of every rule's parameters occurs at least once per job, every green
run that is checked had something to find (drift, view growth), and the test ends by asserting
what it covered. ``make soak`` runs the long one: random sequences drawn by Hypothesis
(``SOAK_EXAMPLES`` of ``SOAK_STEPS`` steps), stopping after ``SOAK_MINUTES`` and ending with a
summary of what ran; a failure is shrunk and printed with a blob that reproduces it. A
counterexample becomes a plain regression test (tests/test_sequences.py).
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from datetime import datetime, timedelta
from decimal import Decimal

import jsonschema
import psycopg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pin_nightly import runs
from tests.helpers import failed_tasks, inject, new_id, night, reference_popularity_score
from tools.devenv import run_sql_file
from tools.rundag import clear_and_resume, run_dag

NEWS = "news_comment_reconcile"
CATALOG = "catalog_popularity_recompute"
H = 7
HORIZON = 32  # retention keeps max(window, 30) + 2 days

CUT_BATCHES = 2  # a cut night stops gracefully after this many batches that read rows
HOLD_AFTER_S = 0.4  # a held hot-path transaction commits this long after the batch it blocked

PROFILE_NAME = os.environ.get("PIN_MODEL_PROFILE", "make-test")
SOAK = settings(
    stateful_step_count=int(os.environ.get("SOAK_STEPS", "20")),
    derandomize=False,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)

# where a run may fail: (function wrapped, how it fails, card kind) -- see helpers.inject
FAULTS = {
    "catalog": {
        "plan_before": ("pin_nightly.runs.plan", "before", None),
        "mid_batch": ("pin_nightly.catalog.make_batch", "mid_batch", "PropertyObject"),
        "projects_mid_batch": ("pin_nightly.catalog.make_batch", "mid_batch", "Project"),
        "range_after_work": ("pin_nightly.ranges.run_range", "after", None),
        "summarize_before": ("pin_nightly.runs.summarize", "before", None),
        "summarize_after": ("pin_nightly.runs.summarize", "after", None),  # its signals stored
    },
    "news": {
        "plan_before": ("pin_nightly.runs.plan", "before", None),
        "mid_batch": ("pin_nightly.news.make_batch", "mid_batch", None),
        "range_after_work": ("pin_nightly.ranges.run_range", "after", None),
        "summarize_before": ("pin_nightly.runs.summarize", "before", None),
        "summarize_after": ("pin_nightly.runs.summarize", "after", None),  # its signals stored
    },
}
CLEARS = ["failed_tasks", "only_failed", "whole_run"]
CUTS = [None, "graceful", "budget"]  # graceful: run_deadline_at moved to now() mid-run
TRAFFIC = [None, "commit", "hold"]  # hot path during the run's first batch
POISON = ["one", "all", "none"]  # a domain trigger rejecting one row, every row, none

# Every rule's parameters and all their values: the soak draws from them, the bounded profile
# covers each value at least once (and says so at the end).
DOMAINS = {
    "news": {
        "hot_path": {"post": list(range(8)), "op": ["add", "hide", "lost", "corrupt"]},
        "scheduled_night": {
            "cut": CUTS,
            "ranges": [1, 2, 3],
            "traffic": TRAFFIC,
        },
        "manual_run": {
            "what": [
                "FullSweep",
                "DailyWindow",
                "targeted",
                "targeted_missing",
                "dry_run",
                "out_of_time",
            ],
            "when": ["now", "past", "future"],
            "traffic": TRAFFIC,
        },
        "a_failure_ahead": {"fault": list(FAULTS["news"])},
        "clear_a_failed_run": {"how": CLEARS, "late": [False, True]},
        "poison": {"rows": POISON},
    },
    "catalog": {
        "views_grow": {"cards": ["all", "property", "project", "one"], "amount": [0, 5, 40]},
        "scheduled_night": {
            "gap": [1, 2, 12, 20],
            "cut": CUTS,
            "ranges": [1, 2, 3],
            "traffic": TRAFFIC,
        },
        "manual_run": {
            "when": ["today", "last_night", "past", "future"],
            "extra": ["plain", "dry_run", "targeted", "targeted_missing", "window", "half_life"],
            "traffic": TRAFFIC,
        },
        "a_failure_ahead": {"fault": list(FAULTS["catalog"])},
        "clear_a_failed_run": {"how": CLEARS, "late": [False, True]},
        "poison": {"rows": POISON},
        "day_turns": {"days": [1, 2]},
    },
}
DOMAINS["news"]["backfill_run"] = {"age": [1, 5]}
DOMAINS["catalog"]["backfill_run"] = {"age": [1, 5]}


def values(job: str, rule_name: str, param: str):
    return st.sampled_from(DOMAINS[job][rule_name][param])


def domain(job: str) -> set[tuple]:
    return {(r, p, v) for r, params in DOMAINS[job].items() for p, vs in params.items() for v in vs}


_sleep = time.sleep
_validate = jsonschema.validate
_DAG_TEST = os.path.join("sdk", "definitions", "dag.py")


def _quick_poll(seconds: float) -> None:
    """``dag.test()`` polls its run once a second while tasks wait for the state of their
    upstream tasks (a failed run's downstream); a twentieth of that is enough here."""
    quick = seconds == 1 and sys._getframe(1).f_code.co_filename.endswith(_DAG_TEST)
    _sleep(0.05 if quick else seconds)


_checked_schemas: set[str] = set()


def _validate_checked_once(instance, schema, cls=None, *args, **kwargs) -> None:
    """``jsonschema.validate`` that checks each schema itself once, not at every call (Airflow
    resolves every param of the DAG, schema check included, in every task: a quarter of a
    run's time here); the value is validated every time, as before."""
    import jsonschema

    key = json.dumps(schema, sort_keys=True, default=str)
    if key not in _checked_schemas:
        _validate(instance, schema, cls, *args, **kwargs)
        _checked_schemas.add(key)
        return
    validator = (cls or jsonschema.validators.validator_for(schema))(schema, *args, **kwargs)
    error = jsonschema.exceptions.best_match(validator.iter_errors(instance))
    if error is not None:
        raise error


# what every machine of this session did, by job: the soak's summary
SESSION: dict[str, Counter] = defaultdict(Counter)

HOT_PATH = "SET pin_test.hot_path = 'on'"  # the poison triggers let the hot path's writes by


class Model(RuleBasedStateMachine):
    """What both jobs' models share: running a DAG with a fault, a cut budget and traffic
    during its batches, clearing a failed run, poison rows, and the invariants on every run's
    outcome."""

    dag_id = ""
    job = ""
    table = ""  # the domain table the poison trigger is on (catalog: both card tables)
    conf: dict = {}

    def __init__(self, db):
        super().__init__()
        self.db = db
        db.q(HOT_PATH)
        self.today = db.today()
        self.failed: list[dict] = []  # failed runs a data team may clear, oldest first
        self.last: dict | None = None
        self.covered: set[tuple] = set()
        self.checked: list[tuple] = []  # (what was checked, whether it had something to find)
        self.poisoned: set[str] | None = set()  # None: every row
        self.newest_night = None  # the newest date a run was about
        self.fault_ahead: str | None = None  # where the next run fails

    # --- bookkeeping ---------------------------------------------------------------------

    def cover(self, rule_name: str, **params) -> None:
        for p, v in params.items():
            self.covered.add((rule_name, p, v))
        SESSION[self.job][rule_name] += 1

    def checked_run(self, what: str, found: bool) -> None:
        self.checked.append((what, found))

    # --- running -------------------------------------------------------------------------

    def run(
        self,
        conf: dict,
        logical,
        day,
        fault: str | None,
        again_of: dict | None = None,
        cut: str | None = None,
        traffic: str | None = None,
        run_id: str | None = None,
    ):
        """Run the DAG (``logical``: its logical date, None for a manual run without one; ``day``
        the date it is about), with ``fault`` injected, its budget cut (``cut``) and hot-path
        traffic during its first batch (``traffic``); or clear ``again_of``, a failed run."""
        first_at = again_of["first_at"] if again_of else self.db.one("SELECT clock_timestamp()")
        # what the run had to find when it was first attempted
        before = again_of["before"] if again_of else self.before_state(conf, day)
        if cut == "budget":
            conf = {**conf, "max_run_duration_minutes": 0.0001}
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(time, "sleep", _quick_poll)
            mp.setattr(jsonschema, "validate", _validate_checked_once)
            if fault is not None:
                inject(mp, *FAULTS[self.job][fault])
            held = self.traffic_during(mp, traffic, day) if traffic else None
            if cut == "graceful":
                self.graceful_stop(mp)
            try:
                if again_of is None:
                    r = run_dag(self.dag_id, conf, logical_date=logical, run_id=run_id)
                elif again_of["how"] == "whole_run":  # the same run (id, dates) from the start
                    backfill = again_of["run_id"].startswith("backfill__")
                    r = run_dag(
                        self.dag_id,
                        conf,
                        logical_date=again_of["logical_date"],
                        run_after=again_of["run_after"],
                        run_id=again_of["run_id"] if backfill else None,  # its id says its type
                    )
                    assert r["run_id"] == again_of["run_id"], (r["run_id"], again_of["run_id"])
                else:
                    by_task = again_of["how"] == "failed_tasks"
                    r = clear_and_resume(
                        self.dag_id,
                        again_of["run_id"],
                        task_ids=failed_tasks(again_of) if by_task else None,
                        only_failed=not by_task,
                    )
            finally:
                if held is not None and held["timer"] is not None:
                    held["timer"].join()
        if held is not None:
            assert held["error"] is None, (
                "the hot path's transaction held across a batch was cut off (the job waited "
                f"for its row lock instead of skipping it): {held['error']}"
            )
        r.update(conf=conf, logical=logical, day=day, fault=fault, first_at=first_at)
        # whether the run's options were checked again: a new run, a whole-run clear, or a
        # clear of a run whose validate_options had failed (a refused run)
        again = again_of is not None and again_of["how"] != "whole_run"
        refused_before = again and again_of["tasks"].get("validate_options") == "failed"
        r.update(how=again_of["how"] if again_of else None, revalidated=not again or refused_before)
        r.update(before=before, cut=cut, poisoned=self.poison_union(again_of))
        if fault is None and self.expect_green(r):
            assert r["state"] == "success", ("a run without a fault failed", r["tasks"])
        # dag.test() replaces a run of the same logical date
        self.failed = [
            f
            for f in self.failed
            if f["run_id"] != r["run_id"] and f["logical_date"] != r["logical_date"]
        ]
        if r["state"] == "failed":
            self.failed.append(r)
        self.last = r
        return r

    def expect_green(self, r: dict) -> bool:
        return not r["run_id"].startswith("backfill__") and not self.mostly_failed(r)

    def mostly_failed(self, r: dict) -> bool:
        """Whether the run failed as it must when most of the rows it tried failed (at least
        ``runs.MOSTLY_FAILED_MIN``): only while the trigger rejects every row, and then only
        its summary fails, after the run is logged with how many rows failed."""
        if r["poisoned"] is not None or r["state"] != "failed":
            return False
        code = self.dag_id.replace("_", "-")
        q = "SELECT status FROM pin_nightly.run_log WHERE job = %s AND run_id = %s"
        logged = self.db.q(q, code, r["run_id"])
        status = logged[0][0] if logged else ""
        if not status.startswith(runs.MOSTLY_FAILED):
            return False
        failed, tried = (int(w) for w in status.split()[1:4:2])  # "failed: N of M rows ..."
        assert failed >= runs.MOSTLY_FAILED_MIN and failed * 2 > tried, status
        assert {t.split("[")[0] for t in failed_tasks(r)} <= {"summarize", "publish"}, r["tasks"]
        return True

    def graceful_stop(self, mp) -> None:
        """The documented graceful stop: after :data:`CUT_BATCHES` batches that read rows, the
        run's deadline is moved to now() (in that batch's transaction, which holds the lease row
        FOR SHARE)."""
        module = importlib.import_module(f"pin_nightly.{self.job}")
        real = module.make_batch
        seen = [0]

        @functools.wraps(real)
        def make_batch(*args, **kwargs):
            job = real(*args, **kwargs)
            batch = job.batch

            def cut(cur, *a):
                out = batch(cur, *a)
                if out.last_id is not None:
                    seen[0] += 1
                    if seen[0] == CUT_BATCHES:
                        cur.execute(
                            "UPDATE pin_nightly.job_lease SET run_deadline_at = clock_timestamp()"
                        )
                return out

            job.batch = cut
            return job

        mp.setattr(module, "make_batch", make_batch)

    def traffic_during(self, mp, mode: str, day) -> dict:
        """Hot-path traffic during the run's first batch that reads a row: ``commit`` commits a
        hot-path transaction on another session as the batch starts; ``hold`` opens one on the
        batch's next row, holding its row lock across the batch, and commits it
        :data:`HOLD_AFTER_S` after the batch (the end-of-range retry waits for it)."""
        module = importlib.import_module(f"pin_nightly.{self.job}")
        real = module.make_batch
        state = {"done": False, "timer": None, "error": None}
        model = self

        @functools.wraps(real)
        def make_batch(*args, **kwargs):
            job = real(*args, **kwargs)
            batch = job.batch

            def with_traffic(cur, after_id, upper_id, limit):
                target = None if state["done"] else model.traffic_target(job, after_id, upper_id)
                if target is None:
                    return batch(cur, after_id, upper_id, limit)
                state["done"] = True
                conn = psycopg.connect(model.db.dsn, autocommit=True)
                conn.execute(HOT_PATH)
                # a bound on the model itself: a job that waits for this lock frees it
                conn.execute("SET idle_in_transaction_session_timeout = '3s'")
                if mode == "commit":
                    with conn, conn.transaction():
                        model.hot_write(conn, target, day)
                    return batch(cur, after_id, upper_id, limit)
                tx = conn.transaction()
                tx.__enter__()
                model.hot_write(conn, target, day, commit=False)

                def commit():
                    try:
                        tx.__exit__(None, None, None)
                        model.hot_committed(target, day)
                    except Exception as exc:  # noqa: BLE001 - reported by run()
                        state["error"] = repr(exc)
                    finally:
                        conn.close()

                try:
                    out = batch(cur, after_id, upper_id, limit)
                finally:
                    state["timer"] = threading.Timer(HOLD_AFTER_S, commit)
                    state["timer"].start()
                return out

            job.batch = with_traffic
            return job

        mp.setattr(module, "make_batch", make_batch)
        return state

    def traffic_target(self, job, after_id, upper_id) -> str | None:
        raise NotImplementedError

    def hot_write(self, conn, target: str, day, commit: bool = True) -> None:
        raise NotImplementedError

    def hot_committed(self, target: str, day) -> None:
        """A held hot-path transaction committed (hook)."""

    # --- rules ---------------------------------------------------------------------------

    @precondition(lambda self: self.failed)
    @rule(which=st.integers(min_value=0), how=st.sampled_from(CLEARS))
    def clear_a_failed_run(self, which, how):
        """Clear an earlier failed run, however many runs came since (late: a newer date has
        been run since): its failed task instances (with downstream, and their setup), the
        run's failed tasks ("only failed"), or the whole run."""
        failed = self.failed[which % len(self.failed)]
        day = failed["day"].date() if isinstance(failed["day"], datetime) else failed["day"]
        late = bool(self.newest_night and day and day < self.newest_night)
        self.cover("clear_a_failed_run", how=how, late=late)
        self.before_run(failed["day"])
        self.after_run(
            self.run(
                failed["conf"],
                failed["logical"],
                failed["day"],
                None,
                again_of={**failed, "how": how},
            )
        )

    def arm(self, fault: str) -> None:
        """The next run (scheduled or manual) fails once at ``fault`` (see :data:`FAULTS`)."""
        self.cover("a_failure_ahead", fault=fault)
        self.fault_ahead = fault

    def armed(self) -> str | None:
        fault, self.fault_ahead = self.fault_ahead, None
        return fault

    @rule(rows=st.sampled_from(POISON))
    def poison(self, rows):
        """A domain trigger rejects the job's updates (SQLSTATE P0001, an item error) of one row
        of the domain table, or of every row; or no trigger any more."""
        self.cover("poison", rows=rows)
        for table in self.tables():
            self.db.q(f"DROP TRIGGER IF EXISTS pin_test_poison ON {table}")
        if rows == "none":
            self.poisoned = set()
            return
        target = self.poison_target()
        cond = "true" if rows == "all" else f"NEW.id = '{target}'::uuid"
        self.db.q(
            "CREATE OR REPLACE FUNCTION public.pin_test_poison() RETURNS trigger LANGUAGE plpgsql "
            "AS $$ BEGIN IF current_setting('pin_test.hot_path', true) IS DISTINCT FROM 'on' "
            f"AND {cond} THEN RAISE EXCEPTION 'rejected (simulated)' USING ERRCODE = "
            "'raise_exception'; END IF; RETURN NEW; END $$"
        )
        for table in self.tables():
            self.db.q(
                f"CREATE TRIGGER pin_test_poison BEFORE UPDATE ON {table} FOR EACH ROW "
                "EXECUTE FUNCTION public.pin_test_poison()"
            )
        self.poisoned = None if rows == "all" else {target}

    def tables(self) -> list[str]:
        return [self.table]

    def poison_target(self) -> str:
        raise NotImplementedError

    def poison_union(self, again_of: dict | None) -> set[str] | None:
        """The rows the trigger rejected during any attempt of a run (None: every row)."""
        earlier = again_of["poisoned"] if again_of else set()
        if earlier is None or self.poisoned is None:
            return None
        return earlier | self.poisoned

    def is_poisoned(self, row_id: str, r: dict | None = None) -> bool:
        poisoned = self.poisoned if r is None else r["poisoned"]
        return poisoned is None or row_id in poisoned

    def item_error(self, row_id: str, run_id: str) -> bool:
        """The run recorded the row as an item error, or held it back: the row's newest record
        (an earlier run's) has the version the row still has, so the run tried it together with
        the other rows held back and recorded nothing new (``retry_failed_rows`` off)."""
        recorded = "SELECT 1 FROM pin_nightly.item_error WHERE item_id = %s AND run_id = %s"
        held = (
            "SELECT 1 FROM (SELECT row_version FROM pin_nightly.item_error WHERE item_id = %s "
            "ORDER BY recorded_at DESC LIMIT 1) e JOIN {} t ON t.id = %s "
            "AND t.xmin::text = e.row_version"
        )
        return bool(self.db.q(recorded, row_id, run_id)) or any(
            self.db.q(held.format(table), row_id, row_id) for table in self.tables()
        )

    def before_state(self, conf: dict, day) -> dict:
        """What the model records before a run (hook)."""
        return {}

    def before_run(self, day) -> None:
        """Record what the model needs to know before a run (hook)."""

    def after_run(self, r: dict) -> None:
        """Check what a run must have done and update the model (hook)."""

    # --- invariants ----------------------------------------------------------------------

    @invariant()
    def the_lease_is_free_between_runs(self):
        assert self.db.q("SELECT holder FROM pin_nightly.job_lease") == []

    @invariant()
    def a_run_sends_each_total_once(self):
        """What the acquisitions of a run sent of its totals adds up to the totals its newest
        one counted: a whole-run clear sends only what the run had not sent."""
        sent: dict[tuple, dict] = defaultdict(Counter)
        whole: dict[tuple, dict] = {}
        for job, run_id, signals in self.db.q(
            "SELECT job, run_id, signals FROM pin_nightly.run_signal ORDER BY emitted_at"
        ):
            key = (job, run_id)
            for name, value, tags in signals["run_totals"]:
                sent[key][json.dumps([name, tags], sort_keys=True)] += value
            whole[key] = Counter(
                {json.dumps([n, t], sort_keys=True): v for n, v, t in signals["whole"]}
            )
        for key, counted in whole.items():
            assert +sent[key] == +counted, (key, dict(sent[key]), dict(counted))

    @invariant()
    def a_green_run_says_what_it_did(self):
        r = self.last
        if r is None or r["state"] != "success":
            return
        s = r["summary"]
        assert s is not None, r["tasks"]
        if s["status"] == "success":
            open_sweeps = self.db.q(
                "SELECT sweep_id, scope FROM pin_nightly.sweep "
                "WHERE status = 'open' AND (resumable OR run_id = %s)",
                r["run_id"],
            )
            assert open_sweeps == [] and s["backlog_remaining"] is False, (open_sweeps, s)
        else:
            assert s["status"] == "backlog_remaining" or s["status"].startswith(
                ("skipped, lock held", "nothing written: ")
            ), s


class CatalogModel(Model):
    """Six cards of each kind whose counters grow between nights (and during runs); scheduled
    nights from 59 days back (some missed, some far apart: retention deletes), with one to three
    ranges, cut budgets, traffic; manual runs (today, the last night's date, a past date, a
    future date; dry, targeted, targeted at a card that does not exist, another window or
    half-life); failures at any point, late clears of any failed run; poison cards; the date
    turning between steps. Every run happens "as of" the model's day, through the job's
    documented clock (``pin_nightly.today``, docs/development.md): a night's steps may straddle
    midnight UTC in the model, never by the machine's clock."""

    dag_id = CATALOG
    job = "catalog"
    conf = {"batch_size": 2, "max_ranges": 2}

    def __init__(self, db):
        super().__init__(db)
        # the model's day never passes the real date: the table owner's partition functions
        # bound their nights by the real date, which the job's clock is never after
        self.limit = self.today
        self.night = self.today - timedelta(days=60)  # the last scheduled night
        self.set_clock(self.night)
        self.cards = {
            db.card(views=10 * i + 5, kind=kind): kind
            for i in range(6)
            for kind in ("PropertyObject", "Project")
        }
        # date -> card -> the counter values a run dated that day could have stamped: those of
        # the runs of that date while no newer date had been written
        self.seen: dict = defaultdict(lambda: defaultdict(set))
        # a night before the first: every card's first night has a delta to score
        for cid, v in self.views().items():
            db.seed_snapshot(cid, self.night, v - 5, self.cards[cid])
            self.seen[self.night][cid].add(v - 5)
        self.hot_views: dict = {}
        # dates whose nightly passes all ended in a green success -> the cards they wrote
        self.complete: dict = {}
        self.cycle: set = set()  # cards cut nights reached since all were last reached
        self.starved: str | None = None  # the card kind the last cut night reached nothing of
        self.stamp_ok = False  # the run in progress may stamp its date (no newer date written)
        self.superseded = False  # a newer date than the run's had been written before it
        self.before_scores: dict = {}  # card -> its score before the run in progress
        self.before_history: list = []  # (card, night) of every snapshot before it
        self.before_kept: list = []  # the scores kept through the first nights before it
        self.pruned_as_of = None  # the newest date whose retention ran (its horizon's base)

    def tables(self) -> list[str]:
        return list(self.db.TABLES.values())

    def poison_target(self) -> str:
        return sorted(self.cards)[4]

    def views(self) -> dict:
        return dict(
            self.db.q(
                "SELECT id::text, popularity_views FROM catalog.property_object_cards UNION ALL "
                "SELECT id::text, popularity_views FROM catalog.project_cards"
            )
        )

    def newest_date(self):
        return self.db.one(
            "SELECT greatest((SELECT max(run_date) FROM catalog.popularity_daily_views), "
            "(SELECT max((params ->> 'as_of_date')::date) FROM pin_nightly.sweep WHERE resumable))"
        )

    def set_clock(self, d) -> None:
        """The model's day: the job's clock of every run from now on."""
        self.today = d
        self.db.set_today(d)

    def past(self, d) -> bool:
        """A night before yesterday: no run writes its snapshots (tonight's carries them)."""
        return d < self.today - timedelta(days=1)

    def before_run(self, d) -> None:
        newest = self.newest_date()
        self.superseded = newest is not None and newest > d
        self.stamp_ok = not self.superseded and not self.past(d)
        if self.stamp_ok:
            for cid, v in self.views().items():
                self.seen[d][cid].add(v)
        self.before_scores = {cid: self.db.score(cid, kind) for cid, kind in self.cards.items()}
        self.before_history = self.db.q(
            "SELECT card_id::text, run_date FROM catalog.popularity_daily_views"
        )
        self.before_kept = self.db.q("SELECT card_id::text FROM pin_nightly.popularity_inherited")

    def before_state(self, conf: dict, day) -> dict:
        """The cards whose counter grew since their newest snapshot before ``day`` (what a
        checked run has to find), and the oldest night past the horizon."""
        grown = {
            cid
            for cid, v, prev in self.db.q(
                "SELECT c.id::text, c.popularity_views, (SELECT s.cumulative_views FROM "
                "catalog.popularity_daily_views s WHERE s.card_id = c.id AND s.run_date < %s "
                "ORDER BY s.run_date DESC LIMIT 1) FROM (SELECT id, popularity_views FROM "
                "catalog.property_object_cards UNION ALL SELECT id, popularity_views FROM "
                "catalog.project_cards) c",
                day,
            )
            if prev is not None and v is not None and v > prev
        }
        oldest = self.db.one("SELECT min(run_date) FROM catalog.popularity_daily_views")
        return {"grown": grown, "oldest": oldest}

    def expect_green(self, r: dict) -> bool:
        """Refused before any write: a run dated after the model's day, or a past night's run
        whose options are checked again (a new run, a whole-run clear, a clear of a refused
        run); a clear of other tasks of a past night's run writes nothing and ends green."""
        past = self.past(r["day"]) and r["revalidated"]
        return r["day"] <= self.today and not past and super().expect_green(r)

    def catalog_run(self, conf: dict, logical, fault, cut=None, traffic=None, run_id=None):
        d = logical.date()
        self.before_run(d)
        r = self.run(
            {**self.conf, **conf}, logical, d, fault, cut=cut, traffic=traffic, run_id=run_id
        )
        if run_id is None:
            self.after_run(r)
        return r

    def after_run(self, r: dict) -> None:
        s, conf = r["summary"] or {}, r["conf"]
        if s.get("status", "").startswith("nothing written"):
            # only a newer date written before the run, or a night past by the run's clock
            assert self.superseded or self.past(r["day"]), (s["status"], r["day"], self.today)
        self.check_inherited(r)
        if r["tasks"].get("retention") in ("success", "failed"):
            self.pruned_as_of = max(filter(None, [self.pruned_as_of, r["day"]]))
        if r["state"] == "success" and r["cut"] == "graceful" and r["fault"] is None:
            self.check_cut_night(r)
        else:  # the check is about consecutive cut nights
            self.cycle, self.starved = set(), None
        if r["state"] == "success" and r["cut"]:
            self.check_retention_under_cut(r)
        if r["state"] != "success" or s.get("status") != "success" or conf.get("dry_run"):
            return
        if conf.get("card_ids"):
            targeted = [c for c in conf["card_ids"] if c in self.cards]
            self.checked_run("targeted", bool(set(targeted) & r["before"]["grown"]))
            self.check_scores(r, targeted, 30)
            for cid in conf["card_ids"]:
                if cid not in self.cards:  # a card that does not exist: nothing of it anywhere
                    assert not self.db.snapshots(cid) and not self.item_error(cid, r["run_id"])
            return
        window = conf.get("window_days", 30)
        self.checked_run(f"as of {r['day']} window {window}", bool(r["before"]["grown"]))
        written = self.check_scores(r, list(self.cards), window, conf.get("half_life_days", H))
        if "window_days" not in conf and "half_life_days" not in conf:
            self.complete[r["day"]] = written
        self.cycle, self.starved = set(), None
        # retention: nothing older than the horizon is kept
        keep = max(window, 30) + 2
        oldest = self.db.one("SELECT min(run_date) FROM catalog.popularity_daily_views")
        assert oldest is None or oldest >= r["day"] - timedelta(days=keep), (oldest, r["day"])

    def inherited(self, cid: str):
        """The score a card kept through the first nights, and its night (None: none)."""
        rows = self.db.q(
            "SELECT score, as_of FROM pin_nightly.popularity_inherited WHERE card_id = %s", cid
        )
        return rows[0] if rows else None

    def check_inherited(self, r: dict) -> None:
        """A score kept by this run (docs/design.md, "First nights") was the card's score
        before it, positive, of a card with no earlier snapshot in the horizon, on a night
        whose window the job's history did not cover (a new platform, or a gap longer than
        the window)."""
        d = r["day"]
        window = r["conf"].get("window_days", 30)
        kept = self.db.q(
            "SELECT card_id::text, score FROM pin_nightly.popularity_inherited WHERE as_of = %s",
            d,
        )
        for cid, score in kept:
            if cid not in self.before_scores or (cid,) in self.before_kept:
                continue
            horizon = d - timedelta(days=window + 2)
            before = [k for c, k in self.before_history if c == cid and horizon <= k < d]
            covered = [k for _, k in self.before_history if k <= d - timedelta(days=window)]
            assert score == self.before_scores[cid] and score > 0, (cid, d, score)
            assert not covered and not before, (
                "a score kept outside the first nights",
                cid,
                d,
                sorted(before),
            )

    def check_scores(self, r: dict, cards, window: int, h: float = H) -> set[str]:
        """Every card's score is the formula over its stored snapshots, plus the score it kept
        through the first nights (:meth:`check_inherited`); returns the cards written (all but
        those the poison trigger rejected)."""
        d, written = r["day"], set()
        for cid in cards:
            kind = self.cards[cid]
            snaps = dict(self.db.snapshots(cid))
            exact = d in snaps and self.db.score(cid, kind) == reference_popularity_score(
                snaps, d, window, h, self.inherited(cid)
            )
            if self.is_poisoned(cid, r) and not exact:
                # a card the trigger rejects: isolated and recorded as an item error
                assert self.item_error(cid, r["run_id"]), (cid, d)
                continue
            assert exact, (cid, d, window, h, sorted(snaps.items()), self.db.score(cid, kind))
            written.add(cid)
        return written

    def considered(self) -> set[str]:
        """The cards a cut night must make progress on: all but the poisoned."""
        if self.poisoned is None:
            return set()
        return {c for c in self.cards if c not in self.poisoned}

    def check_cut_night(self, r: dict) -> None:
        """A night cut after a few batches reaches at least one card that the cut nights since
        every card was last reached did not: every card gets its snapshot within about
        ceil(cards / cards per night) + 1 nights, even while every night is cut."""
        s = r["summary"] or {}
        if not s.get("status", "").startswith(("success", "backlog_remaining")):
            return
        todo = self.considered()
        reached = {c for c in todo if r["day"] in dict(self.db.snapshots(c))}
        if self.starved is not None:
            # the pass a cut night left without a card goes first the next night
            behind = {c for c in todo if self.cards[c] == self.starved}
            assert not behind or reached & behind, (
                "the pass a cut night reached nothing of did not go first",
                self.starved,
                r["day"],
            )
        kinds = {self.cards[c] for c in reached}
        starved = {self.cards[c] for c in todo} - kinds
        self.starved = starved.pop() if len(starved) == 1 else None
        if todo and not todo <= self.cycle:
            assert reached - self.cycle, (
                "a cut night reached no card that the cut nights before it had not",
                r["day"],
                sorted(sorted(todo).index(c) for c in reached),
                sorted(sorted(todo).index(c) for c in self.cycle),
            )
        self.cycle |= reached
        if todo <= self.cycle:
            self.cycle = set()

    def check_retention_under_cut(self, r: dict) -> None:
        oldest = r["before"]["oldest"]
        s = r["summary"] or {}
        if oldest is None or s.get("status", "").startswith("nothing written"):
            return
        if r["conf"].get("dry_run") or r["conf"].get("card_ids"):
            return
        if oldest < r["day"] - timedelta(days=HORIZON):
            assert not self.db.q(
                "SELECT 1 FROM catalog.popularity_daily_views WHERE run_date = %s", oldest
            ), ("retention kept the oldest night past the horizon under a cut budget", oldest)

    def traffic_target(self, job, after_id, upper_id) -> str | None:
        table = self.db.TABLES[job.kind]
        rows = self.db.q(
            f"SELECT id::text FROM {table} WHERE (%s::uuid IS NULL OR id > %s::uuid) "
            "AND (%s::uuid IS NULL OR id <= %s::uuid) ORDER BY id LIMIT 1",
            after_id,
            after_id,
            upper_id,
            upper_id,
        )
        return rows[0][0] if rows else None

    def hot_write(self, conn, target: str, day, commit: bool = True) -> None:
        table = self.db.TABLES[self.cards[target]]
        (self.hot_views[target],) = conn.execute(
            f"UPDATE {table} SET popularity_views = popularity_views + 3 WHERE id = %s "
            "RETURNING popularity_views",
            (target,),
        ).fetchone()
        if commit:
            self.hot_committed(target, day)

    def hot_committed(self, target: str, day) -> None:
        if self.stamp_ok:
            self.seen[day][target].add(self.hot_views[target])

    @rule(
        cards=values("catalog", "views_grow", "cards"),
        amount=values("catalog", "views_grow", "amount"),
    )
    def views_grow(self, cards, amount):
        self.cover("views_grow", cards=cards, amount=amount)
        for kind, table in self.db.TABLES.items():
            if cards in ("all", {"PropertyObject": "property", "Project": "project"}[kind]):
                self.db.q(f"UPDATE {table} SET popularity_views = popularity_views + %s", amount)
        if cards == "one":
            cid = sorted(self.cards)[3]
            table = self.db.TABLES[self.cards[cid]]
            self.db.q(
                f"UPDATE {table} SET popularity_views = popularity_views + %s WHERE id = %s",
                amount,
                cid,
            )

    @precondition(lambda self: self.night < self.limit)
    @rule(
        gap=values("catalog", "scheduled_night", "gap"),
        cut=values("catalog", "scheduled_night", "cut"),
        ranges=values("catalog", "scheduled_night", "ranges"),
        traffic=values("catalog", "scheduled_night", "traffic"),
    )
    def scheduled_night(self, gap, cut=None, ranges=2, traffic=None):
        """The nightly run of ``gap`` nights after the last one (the nights between missed),
        on its own day: the day, if it had turned past that night, is the run's night."""
        self.cover("scheduled_night", gap=gap, cut=cut, ranges=ranges, traffic=traffic)
        self.night = min(max(self.night + timedelta(days=gap), self.today), self.limit)
        self.set_clock(self.night)
        self.newest_night = max(filter(None, [self.newest_night, self.night]))
        self.catalog_run({"max_ranges": ranges}, night(self.night), self.armed(), cut, traffic)

    @rule(
        when=values("catalog", "manual_run", "when"),
        extra=values("catalog", "manual_run", "extra"),
        traffic=values("catalog", "manual_run", "traffic"),
    )
    def manual_run(self, when, extra, traffic=None):
        self.cover("manual_run", when=when, extra=extra, traffic=traffic)
        conf = {
            "plain": {},
            "dry_run": {"dry_run": True},
            "targeted": {"card_ids": sorted(self.cards)[:3]},
            "targeted_missing": {"card_ids": [sorted(self.cards)[5], new_id()]},
            "window": {"window_days": 10},
            "half_life": {"half_life_days": 3},
        }[extra]
        logical = {
            "today": night(self.today) + timedelta(hours=9),  # triggered at noon of the day
            # the last night's date, another logical date (its run stays clearable)
            "last_night": night(self.night) + timedelta(hours=1),
            # a catch-up of a missed night: refused, tonight's run carries its growth
            "past": night(self.night - timedelta(days=3)),
            "future": night(self.today + timedelta(days=5)),
        }[when]
        d = logical.date()
        if d <= self.today and not self.past(d):
            self.newest_night = max(filter(None, [self.newest_night, d]))
        before = self.db.q("SELECT * FROM catalog.popularity_daily_views ORDER BY id")
        r = self.catalog_run(conf, logical, self.armed(), traffic=traffic)
        if d > self.today or self.past(d):
            assert r["state"] == "failed" and r["tasks"]["validate_options"] == "failed", r
            assert self.db.q("SELECT * FROM catalog.popularity_daily_views ORDER BY id") == before

    @precondition(lambda self: self.today < self.limit)
    @rule(days=values("catalog", "day_turns", "days"))
    def day_turns(self, days):
        """The date turns with no scheduled night (a run of the last night is then yesterday's,
        two turns make it past): what a sequence whose steps straddle midnight UTC sees."""
        self.cover("day_turns", days=days)
        self.set_clock(min(self.today + timedelta(days=days), self.limit))

    @rule(age=values("catalog", "backfill_run", "age"))
    def backfill_run(self, age):
        """An Airflow backfill of a date ``age`` days back: before yesterday it is refused
        before any write, as any run of a past night is (tonight's run carries the growth)."""
        self.cover("backfill_run", age=age)
        d = self.today - timedelta(days=age)
        before = self.db.q("SELECT * FROM catalog.popularity_daily_views ORDER BY id")
        r = self.catalog_run({}, night(d), None, run_id=f"backfill__{night(d).isoformat()}")
        if age > 1:
            assert r["tasks"]["validate_options"] == "failed", r["tasks"]
            assert self.db.q("SELECT * FROM catalog.popularity_daily_views ORDER BY id") == before
        else:
            assert r["state"] == "success" or self.mostly_failed(r), r["tasks"]
            self.after_run(r)

    @rule(fault=values("catalog", "a_failure_ahead", "fault"))
    def a_failure_ahead(self, fault):
        self.arm(fault)

    @invariant()
    def snapshots_are_the_counter_of_their_own_night(self):
        for cid, d, v in self.db.q(
            "SELECT card_id::text, run_date, cumulative_views FROM catalog.popularity_daily_views"
        ):
            assert d <= self.today, (cid, d)
            assert v in self.seen[d][cid], (cid, d, v, sorted(self.seen[d][cid]))

    @invariant()
    def no_snapshot_of_a_complete_night_in_the_horizon_is_lost(self):
        """The horizon counts back from the newest snapshot, or from the newest date whose
        retention ran (a cut night that wrote nothing still prunes past its own horizon)."""
        stored = self.db.one("SELECT max(run_date) FROM catalog.popularity_daily_views")
        newest = max(filter(None, [stored, self.pruned_as_of]), default=None)
        for d, written in self.complete.items():
            if newest is not None and d >= newest - timedelta(days=HORIZON):
                for cid in written:
                    assert d in dict(self.db.snapshots(cid)), (cid, d)

    @invariant()
    def every_score_has_four_decimals_and_is_not_negative(self):
        for cid, kind in self.cards.items():
            score = self.db.score(cid, kind)
            assert score >= 0 and score == Decimal(score).quantize(Decimal("0.0001"))


class NewsModel(Model):
    """Eight posts with comments; the hot path adds and hides comments (and its bug loses the
    counter update now and then), between runs and during a run's batches; someone corrupts a
    counter outside any comment activity; scheduled nights (auto: DailyWindow, FullSweep on
    Sundays) with one to three ranges, cut budgets; manual runs (either scope, targeted, at a
    post that does not exist, dry, a run out of budget, any date), failures at any point, late
    clears; poison posts."""

    dag_id = NEWS
    job = "news"
    table = "news.posts"
    conf = {"batch_size": 3, "max_ranges": 2}

    def __init__(self, db):
        super().__init__(db)
        # the last scheduled night: a Saturday 12 to 18 days back, so that the sequences' first
        # scheduled night is a Sunday (auto: a FullSweep) and the ones after it DailyWindows,
        # whatever the date the test runs on
        start = self.today - timedelta(days=12)
        self.night = start - timedelta(days=(start.weekday() - 5) % 7)
        self.posts = [db.post(count=v, visible=v) for v in (0, 1, 2, 3, 1, 0, 4, 2)]
        # every change the model made to a counter directly (the hot path's own updates, a
        # corruption): with the corrections the job recorded, the counter is accounted for
        self.moved = dict.fromkeys(self.posts, 0)
        self.start = {p: db.count(p) for p in self.posts}
        # posts a green DailyWindow may leave wrong: drift it could not see (no comment
        # activity); a FullSweep that spans runs does not look again at a range it finished
        self.silent: set[str] = set()
        self.drift_at: dict = {}  # post -> when the bug or a corruption last hit it
        self.left_by_cut: set[str] = set()  # posts the last cut DailyWindow left wrong
        # the covering sequences make sure that what a cut window left is within the next
        # one's batches; random sequences do not (the check is the bounded profile's)
        self.strict = False

    def poison_target(self) -> str:
        return self.posts[5]

    def exact(self, p: str) -> bool:
        return self.db.count(p) == self.visible(p)

    def before_state(self, conf: dict, day) -> dict:
        return {"wrong": {p for p in self.posts if not self.exact(p)}}

    def after_run(self, r: dict) -> None:
        s, conf = r["summary"] or {}, r["conf"]
        if self.strict:
            self.check_cut_window(r)
        if r["state"] != "success" or s.get("status") != "success":
            return
        if conf.get("dry_run"):
            return
        wrong = {p for p in self.posts if not self.exact(p)}
        if conf.get("post_ids"):
            targeted = [p for p in conf["post_ids"] if p in self.moved]
            self.checked_run("targeted", bool(set(targeted) & r["before"]["wrong"]))
            for p in targeted:
                assert p not in wrong or self.rejected(p, r), (s, p)
            self.silent -= set(targeted) - wrong
            for p in conf["post_ids"]:
                if p not in self.moved:  # a post that does not exist: nothing of it anywhere
                    assert not self.db.q(
                        "SELECT 1 FROM pin_nightly.news_drift WHERE post_id = %s", p
                    ) and not self.item_error(p, r["run_id"])
            return
        if s["sweep_id"] is None:  # it owned no sweep of its scope (all done by others)
            return
        if s["scope"] == "FullSweep":
            # a sweep that spans runs does not look again at a range it finished: drift since
            # the sweep started may be left
            since = self.db.one(
                "SELECT started_at FROM pin_nightly.sweep WHERE sweep_id = %s", s["sweep_id"]
            )
            found = bool(r["before"]["wrong"])
        else:
            # a window reaches back to the last completed sweep: only drift since this run's
            # first attempt may be left (and drift without comment activity)
            since = r["first_at"]
            found = bool(r["before"]["wrong"] - self.silent)
        self.checked_run(s["scope"], found)
        later = {p for p, at in self.drift_at.items() if at > since}
        allowed = later if s["scope"] == "FullSweep" else self.silent | later
        left = {p for p in wrong - allowed if not self.rejected(p, r)}
        assert not left, (s, left, allowed)
        self.silent = wrong

    def rejected(self, p: str, r: dict) -> bool:
        """A post the poison trigger rejects and the run recorded as an item error."""
        return self.is_poisoned(p, r) and self.item_error(p, r["run_id"])

    def check_cut_window(self, r: dict) -> None:
        """A DailyWindow cut after a few batches corrects first what the cut window before it
        left wrong (it starts where that one stopped): every post with comment activity is
        corrected within a bounded number of nights however every night is cut. (Only where
        the sequence keeps what was left within the next window's first batches.)"""
        s = r["summary"] or {}
        if r["cut"] != "graceful" or r["fault"] or s.get("scope") != "DailyWindow":
            self.left_by_cut = set()  # the check is about consecutive cut windows
            return
        wrong = {p for p in self.posts if not self.exact(p)}
        left = self.left_by_cut & r["before"]["wrong"]
        assert not left or left - wrong, (
            "a cut DailyWindow corrected nothing of what the cut window before it left",
            sorted(self.posts.index(p) for p in left),
        )
        self.left_by_cut = {p for p in wrong - self.silent if not self.is_poisoned(p, r)}

    def visible(self, pid: str) -> int:
        return self.db.one(
            "SELECT count(*) FROM news.comments WHERE post_id = %s AND status = 'Visible'", pid
        )

    def news_run(self, conf: dict, logical, fault, cut=None, traffic=None, run_id=None) -> dict:
        day = logical
        r = self.run(
            {**self.conf, **conf}, logical, day, fault, cut=cut, traffic=traffic, run_id=run_id
        )
        if run_id is None:
            self.after_run(r)
        return r

    def write(self, conn, pid: str, op: str) -> None:
        """One hot-path transaction's statements on ``conn`` (see :meth:`hot_path`)."""
        if op in ("add", "lost"):
            conn.execute(
                "INSERT INTO news.comments (id, post_id, status, created_at, updated_at) "
                "VALUES (gen_random_uuid(), %s, 'Visible', now(), now())",
                (pid,),
            )
            delta = 1 if op == "add" else 0
        elif op == "hide":
            hidden = conn.execute(
                "UPDATE news.comments SET status = 'HiddenByModerator', updated_at = now() "
                "WHERE id = (SELECT id FROM news.comments WHERE post_id = %s "
                "AND status = 'Visible' LIMIT 1) RETURNING id",
                (pid,),
            ).fetchall()
            delta = -1 if hidden else 0
        else:
            delta = 2
            self.silent.add(pid)
        if op in ("lost", "corrupt"):
            self.drift_at[pid] = conn.execute("SELECT clock_timestamp()").fetchone()[0]
        if delta:
            conn.execute(
                "UPDATE news.posts SET comments_count = comments_count + %s WHERE id = %s",
                (delta, pid),
            )
        self.pending = delta

    @rule(post=values("news", "hot_path", "post"), op=values("news", "hot_path", "op"))
    def hot_path(self, post, op):
        """The service: a comment added or hidden with its counter in one transaction; the bug
        (a comment added, the counter not); a counter corrupted with no comment activity."""
        self.cover("hot_path", post=post, op=op)
        pid = self.posts[post]
        with self.db.conn.transaction():
            self.write(self.db.conn, pid, op)
        self.moved[pid] += self.pending

    def traffic_target(self, job, after_id, upper_id) -> str | None:
        rows = [p for p in sorted(self.posts) if after_id is None or p > after_id]
        rows = [p for p in rows if upper_id is None or p <= upper_id]
        return rows[0] if rows else None

    def hot_write(self, conn, target: str, day, commit: bool = True) -> None:
        self.write(conn, target, "add")
        if commit:
            self.hot_committed(target, day)

    def hot_committed(self, target: str, day) -> None:
        self.moved[target] += 1

    @precondition(lambda self: self.night < self.today)
    @rule(
        cut=values("news", "scheduled_night", "cut"),
        ranges=values("news", "scheduled_night", "ranges"),
        traffic=values("news", "scheduled_night", "traffic"),
    )
    def scheduled_night(self, cut=None, ranges=2, traffic=None):
        self.cover("scheduled_night", cut=cut, ranges=ranges, traffic=traffic)
        self.night += timedelta(days=1)
        self.newest_night = self.night
        # 03:00 in Moscow; auto is a FullSweep on Sundays
        logical = night(self.night) - timedelta(hours=3)
        self.news_run({"max_ranges": ranges}, logical, self.armed(), cut, traffic)

    @rule(
        what=values("news", "manual_run", "what"),
        when=values("news", "manual_run", "when"),
        traffic=values("news", "manual_run", "traffic"),
    )
    def manual_run(self, what, when, traffic=None):
        self.cover("manual_run", what=what, when=when, traffic=traffic)
        conf = {
            "FullSweep": {"scope": "FullSweep"},
            "DailyWindow": {"scope": "DailyWindow"},
            "targeted": {"post_ids": self.posts[:3]},
            "targeted_missing": {"post_ids": [self.posts[6], str(uuid.uuid4())]},
            "dry_run": {"scope": "FullSweep", "dry_run": True},
            "out_of_time": {"scope": "FullSweep", "max_run_duration_minutes": 0.0001},
        }[what]
        logical = {
            "now": None,
            "past": night(self.night - timedelta(days=3)),
            "future": night(self.today + timedelta(days=5)),
        }[when]
        self.news_run(conf, logical, self.armed(), traffic=traffic)

    @rule(age=values("news", "backfill_run", "age"))
    def backfill_run(self, age):
        """An Airflow backfill of a news night ``age`` days back: before yesterday it is refused
        before any write (a run sweeps today's rows whatever its date)."""
        self.cover("backfill_run", age=age)
        logical = night(self.today - timedelta(days=age))
        counts = {p: self.db.count(p) for p in self.posts}
        drift = self.db.one("SELECT count(*) FROM pin_nightly.news_drift")
        r = self.news_run({}, logical, None, run_id=f"backfill__{logical.isoformat()}")
        if age > 1:
            assert r["tasks"]["validate_options"] == "failed", r["tasks"]
            assert {p: self.db.count(p) for p in self.posts} == counts
            assert self.db.one("SELECT count(*) FROM pin_nightly.news_drift") == drift
        else:
            assert r["state"] == "success" or self.mostly_failed(r), r["tasks"]
            self.after_run(r)

    @rule(fault=values("news", "a_failure_ahead", "fault"))
    def a_failure_ahead(self, fault):
        self.arm(fault)

    @invariant()
    def every_correction_is_recorded_once(self):
        recorded = dict(
            self.db.q(
                "SELECT post_id::text, sum(count_to - count_from) FROM pin_nightly.news_drift "
                "WHERE NOT dry_run GROUP BY post_id"
            )
        )
        for pid in self.posts:
            assert self.db.count(pid) == self.start[pid] + self.moved[pid] + recorded.get(pid, 0), (
                pid
            )


# --- the bounded profile: covering sequences --------------------------------------------------
#
# Each sequence is a list of (rule, params); it runs on a fresh database, with every invariant
# checked after every step. Together a job's sequences cover every value of every rule's
# parameters (asserted at the end), and every checked green run follows drift or growth.


def S(rule_name: str, **params) -> tuple:  # noqa: N802 - a step, read as a table
    return (rule_name, params)


def drift(*ops) -> list:
    return [S("hot_path", post=p, op=op) for p, op in ops]


NEWS_SEQUENCES = [
    [
        *drift((0, "lost"), (1, "corrupt"), (2, "add")),
        S("scheduled_night", ranges=3, traffic="hold"),
        *drift((3, "lost"), (4, "hide")),
        S("a_failure_ahead", fault="mid_batch"),
        S("scheduled_night", ranges=1),
        S("clear_a_failed_run", which=-1, how="failed_tasks"),
        S("backfill_run", age=5),
        *drift((0, "lost"), (5, "lost"), (6, "corrupt"), (7, "add"), (1, "add"), (6, "hide")),
        S("scheduled_night", cut="graceful", ranges=2),  # a window left unfinished
        *drift((1, "lost"), (7, "lost")),
        S("scheduled_night", cut="graceful", ranges=2),  # goes on where it stopped
        *drift((0, "hide"), (2, "lost")),
        S("scheduled_night", traffic="commit"),  # its own window covers what they left
        *drift((2, "lost")),
        S("a_failure_ahead", fault="range_after_work"),
        S("scheduled_night", cut="budget"),
        *drift((3, "lost")),
        S("a_failure_ahead", fault="summarize_before"),
        S("scheduled_night"),
        *drift((4, "lost")),
        S("clear_a_failed_run", which=-2, how="only_failed"),  # late: a newer night ran
        S("poison", rows="one"),
        *drift((5, "lost"), (6, "lost")),
        S("clear_a_failed_run", which=-1, how="whole_run"),
        S("poison", rows="all"),
        *drift((7, "lost"), (0, "lost")),
        S("manual_run", what="targeted", when="future"),
        S("poison", rows="none"),
        *drift((6, "lost")),
        S("manual_run", what="targeted_missing", when="now", traffic="commit"),
        *drift((1, "lost")),
        S("manual_run", what="FullSweep", when="now"),
        *drift((2, "lost")),
        S("manual_run", what="DailyWindow", when="past", traffic="hold"),
        *drift((3, "lost")),
        S("backfill_run", age=1),
        S("a_failure_ahead", fault="plan_before"),
        S("manual_run", what="dry_run", when="future"),
        S("manual_run", what="out_of_time", when="now"),
        *drift((5, "lost"), (6, "corrupt")),
        S("manual_run", what="dry_run", when="now"),  # it completes: finds drift, records none
        *drift((4, "lost")),
        S("a_failure_ahead", fault="summarize_after"),
        S("manual_run", what="FullSweep", when="now"),
        S("clear_a_failed_run", which=-1, how="whole_run"),  # its summary had sent the totals
    ],
]

CATALOG_SEQUENCES = [
    [
        S("views_grow", cards="all", amount=5),
        S("scheduled_night", gap=1, ranges=3, traffic="hold"),
        S("backfill_run", age=5),
        S("views_grow", cards="property", amount=40),
        S("a_failure_ahead", fault="mid_batch"),
        S("scheduled_night", gap=2),  # a missed night before it
        S("views_grow", cards="one", amount=40),
        S("clear_a_failed_run", which=-1, how="failed_tasks"),
        S("views_grow", cards="project", amount=5),
        S("scheduled_night", gap=12, ranges=1),
        S("views_grow", cards="all", amount=5),
        S("scheduled_night", gap=20, traffic="commit"),  # 32 days after the second night
        S("views_grow", cards="all", amount=5),
        S("scheduled_night", gap=1, cut="graceful", ranges=2),
        S("views_grow", cards="all", amount=5),
        S("scheduled_night", gap=1, cut="graceful", ranges=2),  # the pass behind goes first
        S("views_grow", cards="all", amount=5),
        S("scheduled_night", gap=1, cut="graceful", ranges=2),  # goes on where it stopped
        S("a_failure_ahead", fault="summarize_before"),
        S("scheduled_night", gap=1, cut="budget"),
        S("views_grow", cards="all", amount=40),
        S("a_failure_ahead", fault="range_after_work"),
        S("manual_run", when="last_night", extra="window"),
        S("views_grow", cards="all", amount=5),
        S("clear_a_failed_run", which=-1, how="only_failed"),
        S("views_grow", cards="all", amount=40),
        S("a_failure_ahead", fault="projects_mid_batch"),
        S("scheduled_night", gap=1),
        S("views_grow", cards="all", amount=40),
        S("manual_run", when="last_night", extra="half_life", traffic="hold"),
        S("poison", rows="one"),
        S("views_grow", cards="all", amount=40),
        S("scheduled_night", gap=1, ranges=3),
        S("views_grow", cards="all", amount=40),
        S("clear_a_failed_run", which=-1, how="whole_run"),  # late: a newer date ran
        S("a_failure_ahead", fault="mid_batch"),
        S("scheduled_night", gap=1),  # its pass stays open
        S("poison", rows="all"),
        S("views_grow", cards="all", amount=5),
        S("day_turns", days=1),
        S("manual_run", when="today", extra="targeted"),  # a newer date's snapshots
        S("poison", rows="none"),
        S("views_grow", cards="all", amount=0),
        S("manual_run", when="today", extra="targeted_missing", traffic="commit"),
        S("views_grow", cards="all", amount=5),
        S("day_turns", days=2),  # the failed night is now past
        S("clear_a_failed_run", which=-1, how="failed_tasks"),  # its range writes nothing
        S("backfill_run", age=1),
        S("a_failure_ahead", fault="plan_before"),
        S("manual_run", when="last_night", extra="dry_run"),
        S("manual_run", when="past", extra="plain"),  # a catch-up: refused, nothing written
        S("manual_run", when="future", extra="plain"),
        S("views_grow", cards="all", amount=5),
        S("a_failure_ahead", fault="summarize_after"),
        S("manual_run", when="today", extra="plain"),
        S("clear_a_failed_run", which=-1, how="whole_run"),  # its summary had sent the totals
    ],
    [  # nights far apart leave empty partitions made ahead older than the oldest snapshots;
        # retention past the deadline must still drop every night past the horizon
        S("scheduled_night", gap=1),
        S("views_grow", cards="all", amount=5),
        S("scheduled_night", gap=12, ranges=1),
        S("views_grow", cards="all", amount=5),
        S("scheduled_night", gap=20, cut="budget"),
        S("views_grow", cards="all", amount=5),
        S("scheduled_night", gap=12, cut="budget"),
        S("views_grow", cards="all", amount=5),
        S("scheduled_night", gap=1, cut="budget"),
    ],
]


# Sequences a catalog soak found failing minutes after midnight UTC (its model took "today"
# once, at the start of a sequence, and reused it after the date turned; and it did not model
# the score a card keeps through first nights that come again after a gap longer than the
# window). Each runs at the day boundary (the date turning before its last steps) and away
# from it.
_MIDNIGHT = [
    S("scheduled_night", gap=12, cut="graceful", ranges=3, traffic="hold"),
    S("manual_run", extra="targeted", when="last_night"),
    S("poison", rows="all"),
    S("scheduled_night", gap=20, cut="graceful", ranges=3),
    S("poison", rows="all"),
    S("poison", rows="all"),
]
_MIDNIGHT_END = [
    S("scheduled_night", cut="budget", gap=2, ranges=3),
    S("manual_run", extra="plain", traffic="hold", when="future"),
    S("manual_run", extra="targeted_missing", traffic="hold", when="last_night"),
    S("manual_run", extra="targeted", traffic="commit", when="today"),
    S("manual_run", extra="dry_run", traffic="commit", when="today"),
    S("scheduled_night", cut="budget", gap=20, ranges=2, traffic="commit"),
    S("manual_run", extra="half_life", when="past"),
    S("manual_run", extra="plain", traffic="commit", when="today"),
]
MIDNIGHT_SEQUENCES = {
    # a run refused as dated in the future, cleared once its night has passed: refused again
    "refused_run_cleared_once_past": [
        S("manual_run", extra="plain", when="future"),
        S("scheduled_night", gap=20),
        S("clear_a_failed_run", which=-1, how="failed_tasks"),
    ],
    "kept_score": [*_MIDNIGHT, S("poison", rows="none"), *_MIDNIGHT_END],
    "kept_score_at_midnight": [
        *_MIDNIGHT,
        S("poison", rows="none"),
        *_MIDNIGHT_END[:-1],
        S("day_turns", days=1),
        _MIDNIGHT_END[-1],
    ],
    "every_card_rejected": [*_MIDNIGHT, S("poison", rows="all"), *_MIDNIGHT_END],
    "every_card_rejected_at_midnight": [
        *_MIDNIGHT,
        S("poison", rows="all"),
        *_MIDNIGHT_END[:-1],
        S("day_turns", days=1),
        _MIDNIGHT_END[-1],
    ],
}


def drive(machine: Model, steps: list) -> None:
    """Run the steps through the machine's rules, checking every invariant after each (a
    clear's ``which`` counts from the newest failed run with negative values)."""
    invariants = [inv.function for inv in machine.invariants]
    for f in invariants:
        f(machine)
    for name, params in steps:
        declared = getattr(type(machine), name).hypothesis_stateful_rule
        for pre in declared.preconditions:
            assert pre(machine), (name, params, "its precondition does not hold")
        getattr(machine, name)(**params)
        for f in invariants:
            f(machine)


def bounded(factory, sequences: list, job: str) -> None:
    covered: set[tuple] = set()
    checked: list[tuple] = []
    for steps in sequences:
        machine = factory()
        machine.strict = True
        drive(machine, steps)
        covered |= machine.covered
        checked += machine.checked
    missing, extra = domain(job) - covered, covered - domain(job)
    assert not missing and not extra, ("coverage", sorted(missing, key=str), sorted(extra, key=str))
    assert checked and all(found for _, found in checked), (
        "a checked green run had nothing to find",
        checked,
    )


SOAK_CHUNK = 3  # sequences per Hypothesis call (its first one is the simplest, and cheap)


def soak(factory, job: str) -> None:
    """Random sequences until ``SOAK_EXAMPLES`` are drawn or ``SOAK_MINUTES`` have passed
    (checked between calls of :data:`SOAK_CHUNK` sequences: stopping inside a call would make
    Hypothesis see its own data generation as flaky); then a summary of what ran."""
    from hypothesis.stateful import run_state_machine_as_test

    examples = int(os.environ.get("SOAK_EXAMPLES", "100"))
    minutes = float(os.environ.get("SOAK_MINUTES", "0") or 0)
    started = time.monotonic()
    ran = [0]

    def machine():
        ran[0] += 1
        return factory()

    while ran[0] < examples and not (minutes and time.monotonic() - started > minutes * 60):
        chunk = settings(SOAK, max_examples=min(SOAK_CHUNK, examples - ran[0]))
        run_state_machine_as_test(machine, settings=chunk)
    steps = SESSION[job]
    print(
        f"\nsoak {job}: {ran[0]} sequence(s) in {(time.monotonic() - started) / 60:.1f} min, "
        f"{sum(steps.values())} steps: " + ", ".join(f"{k} {v}" for k, v in sorted(steps.items()))
    )


def _reset_news(db) -> None:
    db.q("DROP SCHEMA IF EXISTS pin_nightly CASCADE")
    run_sql_file(db.dsn, "schema/pin_nightly.sql")
    db.q("DROP TRIGGER IF EXISTS pin_test_poison ON news.posts")
    db.q("TRUNCATE news.posts, news.comments")


@pytest.mark.long
def test_news_operation_sequences(news_db):
    def machine():
        _reset_news(news_db)
        return NewsModel(news_db)

    if PROFILE_NAME == "soak":
        soak(machine, "news")
    else:
        bounded(machine, NEWS_SEQUENCES, "news")


def _reset_catalog(db) -> None:
    """Empty tables, as the job creates them on its first run, and the job's clock back to the
    real date (a sequence sets it night by night)."""
    db.set_today(None)
    db.q("DROP SCHEMA IF EXISTS pin_nightly CASCADE")
    run_sql_file(db.dsn, "schema/pin_nightly.sql")
    run_sql_file(db.dsn, "schema/catalog_popularity.sql")
    for table in db.TABLES.values():
        db.q(f"DROP TRIGGER IF EXISTS pin_test_poison ON {table}")
    db.q(
        "TRUNCATE catalog.property_object_cards, catalog.project_cards, "
        "catalog.popularity_daily_views"
    )


@pytest.mark.long
def test_catalog_operation_sequences(catalog_db):
    def machine():
        _reset_catalog(catalog_db)
        return CatalogModel(catalog_db)

    if PROFILE_NAME == "soak":
        soak(machine, "catalog")
    else:
        bounded(machine, CATALOG_SEQUENCES, "catalog")


@pytest.mark.long
@pytest.mark.parametrize("name", sorted(MIDNIGHT_SEQUENCES))
def test_catalog_sequences_found_at_the_day_boundary(catalog_db, name):
    _reset_catalog(catalog_db)
    drive(CatalogModel(catalog_db), MIDNIGHT_SEQUENCES[name])


def test_the_named_defects_still_match_the_code():
    """Each defect of ``tools/mutants.toml`` still names text that occurs once in its file, so
    that ``make mutants`` (not part of the suite) does not refuse to start after code moves;
    every job's defects are checked by the bounded profile of that job."""
    from tools import mutants

    defects = mutants.load([])
    assert defects and {m["job"] for m in defects} == {"news", "catalog"}
