"""A model-based test of the operations a data team and the platform perform, in any order.

Hypothesis (``RuleBasedStateMachine``) draws sequences of operations, each one real: a DAG run
through Airflow (``dag.test()``) on a real PostgreSQL, a clear of a failed run, traffic on the
domain tables. After every step the invariants are checked on the database, never on the
runs' counters. The rules and invariants are described in docs/reliability.md ("The model").

Profiles: ``make test`` runs a bounded, derandomized one (the same sequences every time);
``make soak`` runs the long one (``SOAK_EXAMPLES`` sequences, random, ``SOAK_STEPS`` steps
each). A counterexample Hypothesis prints becomes a plain regression test
(tests/test_sequences.py).
"""

from __future__ import annotations

import os
from collections import defaultdict
from datetime import timedelta
from decimal import Decimal

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.helpers import failed_tasks, inject, night, reference_popularity_score
from tools.devenv import run_sql_file
from tools.rundag import clear_and_resume, run_dag

NEWS = "news_comment_reconcile"
CATALOG = "catalog_popularity_recompute"
H = 7
HORIZON = 32  # retention keeps max(window, 30) + 2 days

PROFILES = {
    # the same sequences every time; a failure is reported as found (shrinking it would re-run
    # DAGs for many minutes: reproduce it with the soak profile, which shrinks)
    "make-test": settings(
        max_examples=int(os.environ.get("MODEL_EXAMPLES", "3")),
        stateful_step_count=int(os.environ.get("MODEL_STEPS", "8")),
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    ),
    "soak": settings(
        max_examples=int(os.environ.get("SOAK_EXAMPLES", "100")),
        stateful_step_count=int(os.environ.get("SOAK_STEPS", "20")),
        derandomize=False,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    ),
}
PROFILE = PROFILES[os.environ.get("PIN_MODEL_PROFILE", "make-test")]

# where a run may fail: (function wrapped, how it fails, card kind) -- see helpers.inject
FAULTS = {
    "catalog": {
        "plan_before": ("pin_nightly.catalog.plan_ranges", "before", None),
        "mid_batch": ("pin_nightly.catalog.make_batch", "mid_batch", "PropertyObject"),
        "projects_mid_batch": ("pin_nightly.catalog.make_batch", "mid_batch", "Project"),
        "range_after_work": ("pin_nightly.keyset.run_range", "after", None),
        "summarize_before": ("pin_nightly.catalog.summarize", "before", None),
    },
    "news": {
        "plan_before": ("pin_nightly.news.plan_ranges", "before", None),
        "mid_batch": ("pin_nightly.news.make_batch", "mid_batch", None),
        "range_after_work": ("pin_nightly.keyset.run_range", "after", None),
        "summarize_before": ("pin_nightly.news.summarize", "before", None),
    },
}
faults = lambda job: st.one_of(  # noqa: E731 - most runs do not fail
    st.just(None), st.just(None), st.sampled_from(sorted(FAULTS[job]))
)
CLEARS = ["failed_tasks", "only_failed", "whole_run"]


class Model(RuleBasedStateMachine):
    """What both jobs' models share: running a DAG with a fault, clearing a failed run, and the
    invariants on every run's outcome."""

    dag_id = ""
    job = ""
    conf: dict = {}

    def __init__(self, db):
        super().__init__()
        self.db = db
        self.today = db.today()
        self.night = self.today - timedelta(days=12)  # the last scheduled night
        self.failed: list[dict] = []  # failed runs a data team may clear, oldest first
        self.last: dict | None = None

    def run(self, conf: dict, logical, day, fault: str | None, again_of: dict | None = None):
        """Run the DAG (``logical``: its logical date, None for a manual run without one; ``day``
        the date it is about), with ``fault`` injected; or clear ``again_of``, a failed run."""
        with pytest.MonkeyPatch.context() as mp:
            if fault is not None:
                inject(mp, *FAULTS[self.job][fault])
            if again_of is None:
                r = run_dag(self.dag_id, conf, logical_date=logical)
            elif again_of["how"] == "whole_run":  # the same run (id, dates) from the start
                r = run_dag(
                    self.dag_id,
                    conf,
                    logical_date=again_of["logical_date"],
                    run_after=again_of["run_after"],
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
        r.update(conf=conf, logical=logical, day=day, fault=fault)
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

    @precondition(lambda self: self.failed)
    @rule(which=st.integers(min_value=0), how=st.sampled_from(CLEARS))
    def clear_a_failed_run(self, which, how):
        """Clear an earlier failed run, however many runs came since: its failed task instances
        (with downstream, and their setup), the run's failed tasks ("only failed"), or the
        whole run."""
        failed = self.failed[which % len(self.failed)]
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

    def before_run(self, day) -> None:
        """Record what the model needs to know before a run (hook)."""

    def after_run(self, r: dict) -> None:
        """Check what a run must have done and update the model (hook)."""

    @invariant()
    def the_lease_is_free_between_runs(self):
        assert self.db.q("SELECT holder FROM pin_nightly.job_lease") == []

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
    """Six cards of each kind whose counters grow between nights; scheduled nights (some
    missed), manual runs (today, a past date, a future date, dry, targeted, another window),
    failures at any point, late clears of any failed run."""

    dag_id = CATALOG
    job = "catalog"
    conf = {"batch_size": 2, "max_ranges": 2}

    def __init__(self, db):
        super().__init__(db)
        self.cards = {
            db.card(views=10 * i, kind=kind): kind
            for i in range(6)
            for kind in ("PropertyObject", "Project")
        }
        # date -> card -> the counter values a run dated that day could have stamped: those of
        # the runs of that date while no newer date had been written
        self.seen: dict = defaultdict(lambda: defaultdict(set))
        self.complete: set = set()  # dates whose nightly passes all ended in a green success

    def views(self) -> dict:
        return dict(
            self.db.q(
                "SELECT id::text, popularity_views FROM catalog.property_object_cards UNION ALL "
                "SELECT id::text, popularity_views FROM catalog.project_cards"
            )
        )

    def before_run(self, d) -> None:
        newest = self.db.one(
            "SELECT greatest((SELECT max(run_date) FROM catalog.popularity_daily_views), "
            "(SELECT max((params ->> 'as_of_date')::date) FROM pin_nightly.sweep WHERE resumable))"
        )
        if newest is None or newest <= d:
            for cid, v in self.views().items():
                self.seen[d][cid].add(v)

    def catalog_run(self, conf: dict, logical, fault) -> dict:
        d = (logical or night(self.today)).date()
        self.before_run(d)
        r = self.run({**self.conf, **conf}, logical, d, fault)
        self.after_run(r)
        return r

    def after_run(self, r: dict) -> None:
        s, conf = r["summary"] or {}, r["conf"]
        if r["state"] != "success" or s.get("status") != "success" or conf.get("dry_run"):
            return
        if not conf.get("card_ids"):
            self.check_scores(r["day"], conf.get("window_days", 30))
            if "window_days" not in conf:
                self.complete.add(r["day"])

    def check_scores(self, d, window: int) -> None:
        for cid, kind in self.cards.items():
            snaps = dict(self.db.snapshots(cid))
            assert d in snaps, (cid, d)
            assert self.db.score(cid, kind) == reference_popularity_score(snaps, d, window, H), (
                cid,
                d,
                window,
            )

    @rule(card=st.integers(0, 11), amount=st.integers(0, 40))
    def views_grow(self, card, amount):
        cid = sorted(self.cards)[card]
        table = self.db.TABLES[self.cards[cid]]
        self.db.q(
            f"UPDATE {table} SET popularity_views = popularity_views + %s WHERE id = %s",
            amount,
            cid,
        )

    @precondition(lambda self: self.night < self.today)
    @rule(gap=st.sampled_from([1, 1, 1, 2]), fault=faults("catalog"))
    def scheduled_night(self, gap, fault):
        self.night = min(self.night + timedelta(days=gap), self.today)
        self.catalog_run({}, night(self.night), fault)

    @rule(
        when=st.sampled_from(["today", "past", "future"]),
        extra=st.sampled_from(["plain", "dry_run", "targeted", "window"]),
        fault=faults("catalog"),
    )
    def manual_run(self, when, extra, fault):
        conf = {
            "plain": {},
            "dry_run": {"dry_run": True},
            "targeted": {"card_ids": sorted(self.cards)[:3]},
            "window": {"window_days": 10},
        }[extra]
        logical = {
            "today": None,
            "past": night(self.night - timedelta(days=3)),
            "future": night(self.today + timedelta(days=5)),
        }[when]
        r = self.catalog_run(conf, logical, fault)
        if when == "future":
            assert r["state"] == "failed" and r["tasks"]["validate_options"] == "failed", r

    @invariant()
    def snapshots_are_the_counter_of_their_own_night(self):
        for cid, d, v in self.db.q(
            "SELECT card_id::text, run_date, cumulative_views FROM catalog.popularity_daily_views"
        ):
            assert d <= self.today, (cid, d)
            assert v in self.seen[d][cid], (cid, d, v, sorted(self.seen[d][cid]))

    @invariant()
    def no_snapshot_of_a_complete_night_in_the_horizon_is_lost(self):
        newest = self.db.one("SELECT max(run_date) FROM catalog.popularity_daily_views")
        for d in self.complete:
            if newest is not None and d >= newest - timedelta(days=HORIZON):
                for cid in self.cards:
                    assert d in dict(self.db.snapshots(cid)), (cid, d)

    @invariant()
    def every_score_has_four_decimals_and_is_not_negative(self):
        for cid, kind in self.cards.items():
            score = self.db.score(cid, kind)
            assert score >= 0 and score == Decimal(score).quantize(Decimal("0.0001"))


class NewsModel(Model):
    """Eight posts with comments; the hot path adds and hides comments (and its bug loses the
    counter update now and then), someone corrupts a counter outside any comment activity;
    scheduled nights (auto: DailyWindow, FullSweep on Sundays), manual runs (either scope,
    targeted, dry, a run out of budget, any date), failures at any point, late clears."""

    dag_id = NEWS
    job = "news"
    conf = {"batch_size": 3, "max_ranges": 2}

    def __init__(self, db):
        super().__init__(db)
        self.posts = [db.post(count=v, visible=v) for v in (0, 1, 2, 3, 1, 0, 4, 2)]
        # every change the model made to a counter directly (the hot path's own updates, a
        # corruption): with the corrections the job recorded, the counter is accounted for
        self.moved = dict.fromkeys(self.posts, 0)
        self.start = {p: db.count(p) for p in self.posts}
        # posts a green sweep may leave wrong: drift it could not see (no comment activity,
        # for a DailyWindow), or drift made after the sweep started (a sweep that spans runs
        # does not look again at a range it finished)
        self.silent: set[str] = set()
        self.drift_at: dict = {}  # post -> when the bug or a corruption last hit it

    def after_run(self, r: dict) -> None:
        s, conf = r["summary"] or {}, r["conf"]
        if r["state"] != "success" or s.get("status") != "success":
            return
        if conf.get("dry_run"):
            return
        exact = lambda p: self.db.count(p) == self.visible(p)  # noqa: E731
        if conf.get("post_ids"):
            assert all(exact(p) for p in conf["post_ids"]), s
            self.silent -= set(conf["post_ids"])
            return
        if s["sweep_id"] is None:  # it owned no sweep of its scope (all done by others)
            return
        wrong = {p for p in self.posts if not exact(p)}
        started = self.db.one(
            "SELECT started_at FROM pin_nightly.sweep WHERE sweep_id = %s", s["sweep_id"]
        )
        later = {p for p, at in self.drift_at.items() if at > started}
        allowed = later if s["scope"] == "FullSweep" else self.silent | later
        assert wrong <= allowed, (s, wrong, allowed)
        self.silent = wrong

    def visible(self, pid: str) -> int:
        return self.db.one(
            "SELECT count(*) FROM news.comments WHERE post_id = %s AND status = 'Visible'", pid
        )

    def news_run(self, conf: dict, logical, fault) -> dict:
        r = self.run({**self.conf, **conf}, logical, logical, fault)
        self.after_run(r)
        return r

    @rule(post=st.integers(0, 7), op=st.sampled_from(["add", "hide", "lost", "corrupt"]))
    def hot_path(self, post, op):
        """The service: a comment added or hidden with its counter in one transaction; the bug
        (a comment added, the counter not); a counter corrupted with no comment activity."""
        pid = self.posts[post]
        with self.db.conn.transaction():
            if op in ("add", "lost"):
                self.db.q(
                    "INSERT INTO news.comments (id, post_id, status, created_at, updated_at) "
                    "VALUES (gen_random_uuid(), %s, 'Visible', now(), now())",
                    pid,
                )
                delta = 1 if op == "add" else 0
            elif op == "hide":
                hidden = self.db.q(
                    "UPDATE news.comments SET status = 'HiddenByModerator', updated_at = now() "
                    "WHERE id = (SELECT id FROM news.comments WHERE post_id = %s "
                    "AND status = 'Visible' LIMIT 1) RETURNING id",
                    pid,
                )
                delta = -1 if hidden else 0
            else:
                delta = 2
                self.silent.add(pid)
            if op in ("lost", "corrupt"):
                self.drift_at[pid] = self.db.one("SELECT now()")
            if delta:
                self.db.q(
                    "UPDATE news.posts SET comments_count = comments_count + %s WHERE id = %s",
                    delta,
                    pid,
                )
                self.moved[pid] += delta

    @precondition(lambda self: self.night < self.today)
    @rule(fault=faults("news"))
    def scheduled_night(self, fault):
        self.night += timedelta(days=1)
        # 03:00 in Moscow; auto is a FullSweep on Sundays
        self.news_run({}, night(self.night) - timedelta(hours=3), fault)

    @rule(
        what=st.sampled_from(["FullSweep", "DailyWindow", "targeted", "dry_run", "out_of_time"]),
        when=st.sampled_from(["now", "past", "future"]),
        fault=faults("news"),
    )
    def manual_run(self, what, when, fault):
        conf = {
            "FullSweep": {"scope": "FullSweep"},
            "DailyWindow": {"scope": "DailyWindow"},
            "targeted": {"post_ids": self.posts[:3]},
            "dry_run": {"scope": "FullSweep", "dry_run": True},
            "out_of_time": {"scope": "FullSweep", "max_run_duration_minutes": 0.0001},
        }[what]
        logical = {
            "now": None,
            "past": night(self.night - timedelta(days=3)),
            "future": night(self.today + timedelta(days=5)),
        }[when]
        self.news_run(conf, logical, fault)

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


def _reset_news(db) -> None:
    db.q("DROP SCHEMA IF EXISTS pin_nightly CASCADE")
    run_sql_file(db.dsn, "schema/pin_nightly.sql")
    db.q("TRUNCATE news.posts, news.comments")


def test_news_operation_sequences(news_db):
    from hypothesis.stateful import run_state_machine_as_test

    def machine():
        _reset_news(news_db)
        return NewsModel(news_db)

    run_state_machine_as_test(machine, settings=PROFILE)


def _reset_catalog(db) -> None:
    """Empty tables, as the job creates them on its first run."""
    db.q("DROP SCHEMA IF EXISTS pin_nightly CASCADE")
    run_sql_file(db.dsn, "schema/pin_nightly.sql")
    run_sql_file(db.dsn, "schema/catalog_popularity.sql")
    db.q(
        "TRUNCATE catalog.property_object_cards, catalog.project_cards, "
        "catalog.popularity_daily_views"
    )


def test_catalog_operation_sequences(catalog_db):
    from hypothesis.stateful import run_state_machine_as_test

    def machine():
        _reset_catalog(catalog_db)
        return CatalogModel(catalog_db)

    run_state_machine_as_test(machine, settings=PROFILE)
