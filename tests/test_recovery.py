"""Recovery: no run ends green while work is left behind, and every failure point has a tested
way back.

The first part pins down defects that once let work rot behind green runs. The second part is
the fault matrix: for both DAGs, a failure at each point of a run, followed by each recovery a
data team uses (clearing the failed tasks, clearing one task instance, clearing the whole run,
the next scheduled night, a manual run with other params); after each, invariants are checked
on the database, never on counters: every row exact, every correction applied once, the lease
free, no sweep left open that no future run will finish, an honest result, and no snapshot
history lost.

Failures are injected by wrapping a function of ``pin_nightly`` for one call (``dag.test()``
runs the tasks in this process): ``before`` raises instead of calling it, ``after`` raises once
it has done its work (the task dies between its last write and its return), ``mid_batch``
raises inside the second batch's transaction (as a worker killed mid-batch: the batch is rolled
back; a real SIGKILL is tests/test_reliability.py's).

A failure point's run fails once per worker: its recoveries start from a copy of the job's
database and of Airflow's metadata database as that run left them (see FailedRuns).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from datetime import UTC, date, datetime, timedelta
from typing import Any

import psycopg
import pytest

from tests.helpers import failed_tasks, inject, night, reference_popularity_score
from tools import devenv
from tools.rundag import clear_and_resume, run_dag

NEWS = "news_comment_reconcile"
CATALOG = "catalog_popularity_recompute"


def recover(dag_id: str, how: str, failed: dict, conf: dict, later: datetime, manual: dict) -> dict:
    """The recovery ``how`` after the failed run ``failed`` (see RECOVERIES)."""
    if how == "clear_failed":  # the run's "Clear" with "only failed"
        return clear_and_resume(dag_id, failed["run_id"], only_failed=True)
    if how == "clear_task":  # "Clear" on the failed task instances, with downstream
        return clear_and_resume(
            dag_id, failed["run_id"], task_ids=failed_tasks(failed), only_failed=False
        )
    if how == "clear_run":  # "Clear" on the whole run
        return run_dag(
            dag_id, conf, logical_date=failed["logical_date"], run_after=failed["logical_date"]
        )
    if how == "next_night":
        return run_dag(dag_id, {}, logical_date=later, run_after=later)
    return run_dag(dag_id, manual[how])


def state_invariants(db, r: dict, expect_open: bool) -> None:
    """After a recovery run ``r``: the lease free, no sweep open that no run will finish, a
    sweep left for the next run exactly when ``expect_open``, and the result and run log say
    so (``status`` is ``success`` only when nothing is left)."""
    assert db.q("SELECT holder FROM pin_nightly.job_lease") == []
    assert (
        db.q(
            "SELECT sweep_id, scope FROM pin_nightly.sweep WHERE status = 'open' AND NOT resumable"
        )
        == []
    )
    open_sweeps = db.q("SELECT scope FROM pin_nightly.sweep WHERE status = 'open' AND resumable")
    assert bool(open_sweeps) is expect_open, open_sweeps
    s = r["summary"]
    assert s is not None, r["tasks"]
    assert s["backlog_remaining"] is expect_open, s
    assert (s["status"] == "success") is (not expect_open), s
    logged = db.one("SELECT result FROM pin_nightly.run_log WHERE run_id = %s", r["run_id"])
    assert logged["backlog_remaining"] is expect_open


def fail_once(
    monkeypatch,
    dag_id: str,
    point: str,
    target: str,
    how: str,
    kind: str | None,
    conf: dict,
    logical,
) -> dict:
    """Run the DAG with ``target`` failing once (see inject); the run failed (a teardown's
    failure does not fail the run: then the teardown failed)."""
    fired = inject(monkeypatch, target, how, kind)
    failed = run_dag(dag_id, conf, logical_date=logical, run_after=logical)
    failed["logical_date"] = logical
    assert fired["fired"], point
    if point == "release_lease":
        assert failed["tasks"]["release_lease"] == "failed"
    else:
        assert failed["state"] == "failed", failed["tasks"]
    return failed


class FailedRuns:
    """The failed run of each failure point, made once and kept for the point's other
    recoveries (the cells of a point share an xdist group, hence a worker): a copy of the job's
    database (a PostgreSQL database copied from it) and of Airflow's metadata database (SQLite,
    copied with its backup API), both taken right after the run failed, with what the test
    made (its data, the failed run's outcome). Restored, both are as that run left them; the
    fault injected then has fired and is gone, as in a cell that made the run itself."""

    def __init__(self) -> None:
        self.kept: dict[tuple[str, str], tuple[str, sqlite3.Connection, Any]] = {}

    def get(self, db, key: tuple[str, str], make: Callable[[], Any]) -> Any:
        if key in self.kept:
            copy, metadata, made = self.kept[key]
            _copy_database(db, copy, db.conn.info.dbname)
            _copy_metadata(metadata, into_airflow=True)
            return made
        made = make()
        copy = f"{db.conn.info.dbname}_f{len(self.kept)}"
        metadata = sqlite3.connect(":memory:", check_same_thread=False)
        _copy_database(db, db.conn.info.dbname, copy)
        _copy_metadata(metadata, into_airflow=False)
        self.kept[key] = (copy, metadata, made)
        return made

    def drop(self) -> None:
        with psycopg.connect(devenv.admin_dsn(), autocommit=True) as admin:
            for copy, metadata, _ in self.kept.values():
                admin.execute(f'DROP DATABASE IF EXISTS "{copy}" WITH (FORCE)')
                metadata.close()


def _copy_database(db, source: str, target: str) -> None:
    """Make database ``target`` a copy of ``source`` (one of them ``db``'s); ``db``'s
    connection is closed for the copy (a template may have no session) and reopened."""
    db.conn.close()
    with psycopg.connect(devenv.admin_dsn(), autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            (source,),
        )
    devenv.recreate_database(target, template=source)
    db.conn = psycopg.connect(db.dsn, autocommit=True)


def _copy_metadata(copy: sqlite3.Connection, into_airflow: bool) -> None:
    """Copy Airflow's metadata database to ``copy``, or back from it (its pooled connections
    are dropped, and the next session reads the copy)."""
    from airflow import settings

    raw = settings.engine.raw_connection()
    try:
        live = raw.driver_connection
        if into_airflow:
            copy.backup(live)
        else:
            live.backup(copy)
    finally:
        raw.close()
    if into_airflow:
        settings.engine.dispose()


@pytest.fixture(scope="session")
def failed_runs() -> Iterator[FailedRuns]:
    runs = FailedRuns()
    yield runs
    runs.drop()


RECOVERIES = [
    "clear_failed",
    "clear_task",
    "clear_run",
    "next_night",
    "dry_run",
    "targeted",
    "other_window",
]


def matrix(dag_id: str, classes: dict[str, list[str]]) -> list:
    """The fault matrix's cells, (point, recovery). Failure points fall into classes that
    leave the database in the same state (nothing written; a sweep with ranges undone; ranges
    done but not summarized; the lease not released): ``make test`` runs every other recovery
    of each class (the even ones on the first and third class, the odd ones on the others),
    the class's points taking turns, so that every point is run and every recovery on two
    classes; the other cells are marked ``exhaustive`` (``make test-all``, all of them). The
    cells of a point run on one worker (they share its failed run, see FailedRuns)."""
    cells = []
    for k, points in enumerate(classes.values()):
        chosen = [r for i, r in enumerate(RECOVERIES) if i % 2 == k % 2]
        for recovery in RECOVERIES:
            turn = chosen.index(recovery) % len(points) if recovery in chosen else None
            for j, point in enumerate(points):
                marks = [pytest.mark.xdist_group(f"{dag_id}-{point}")]
                if j != turn:
                    marks.append(pytest.mark.exhaustive)
                cells.append(pytest.param(point, recovery, marks=marks, id=f"{point}-{recovery}"))
    return cells


# ====================================================================== defects, one by one


def _hide_one_comment(db, pid: str) -> None:
    """A moderator hides a visible comment now and the counter is not decremented (drift +1
    with fresh comment activity: a DailyWindow sees it)."""
    db.q(
        "UPDATE news.comments SET status = 'HiddenByModerator', updated_at = now() "
        "WHERE id = (SELECT id FROM news.comments WHERE post_id = %s AND status = 'Visible' "
        "LIMIT 1)",
        pid,
    )


@pytest.mark.parametrize(
    "scope", [pytest.param("FullSweep", marks=pytest.mark.long), "DailyWindow"]
)
def test_news_a_sweep_whose_summary_never_ran_does_not_park_later_drift(
    news_db, monkeypatch, scope
):
    now = datetime.now(UTC)
    ids = [news_db.post(count=4, visible=4, comments_at=now - timedelta(hours=3)) for _ in range(6)]
    conf = {"scope": scope, "batch_size": 2}
    assert run_dag(NEWS, conf)["summary"]["status"] == "success"
    _hide_one_comment(news_db, ids[0])
    inject(monkeypatch, "pin_nightly.runs.summarize", "before")
    dead = run_dag(NEWS, conf)
    assert dead["state"] == "failed" and dead["tasks"]["summarize"] == "failed"
    assert news_db.drifted_posts() == 0  # every range finished before the summary died
    monkeypatch.undo()
    _hide_one_comment(news_db, ids[1])
    _hide_one_comment(news_db, ids[2])
    for _ in range(2):
        s = run_dag(NEWS, conf)["summary"]
        assert s["status"] == "success" and s["backlog_remaining"] is False, s
        assert news_db.drifted_posts() == 0
    assert news_db.q("SELECT count(*) FROM pin_nightly.sweep WHERE status = 'open'") == [(0,)]
    assert sorted(
        r[0] for r in news_db.q("SELECT post_id::text FROM pin_nightly.news_drift")
    ) == sorted(ids[:3])


def test_news_a_full_sweep_stopped_by_its_budget_is_resumed_by_the_next_daily_window(news_db):
    from tests.helpers import when

    news_db.posts(60, drift_every=3)  # quiet drift: only a FullSweep reaches it
    conf = {"batch_size": 2, "max_ranges": 1}
    when(
        lambda: news_db.one("SELECT coalesce(sum(batches), 0) FROM pin_nightly.sweep_range") >= 3,
        lambda: news_db.q("UPDATE pin_nightly.job_lease SET run_deadline_at = now()"),
    )
    s1 = run_dag(NEWS, {**conf, "scope": "FullSweep"})["summary"]
    assert s1["status"] == "backlog_remaining" and 0 < s1["posts_reconciled"] < 60
    # a DailyWindow night whose budget is over at once: the FullSweep is still owed, and the
    # result, the run log and the metric say so
    r2 = run_dag(NEWS, {**conf, "scope": "DailyWindow", "max_run_duration_minutes": 0.0001})
    s2 = r2["summary"]
    assert s2["backlog_remaining"] is True and s2["status"] == "backlog_remaining"
    assert any(u.startswith("FullSweep") for u in s2["unfinished_sweeps"]), s2
    assert (
        news_db.one("SELECT status FROM pin_nightly.run_log WHERE run_id = %s", r2["run_id"])
        == "backlog_remaining"
    )
    # the next DailyWindow night finishes the FullSweep from its cursor
    s3 = run_dag(NEWS, {**conf, "scope": "DailyWindow"})["summary"]
    assert s3["status"] == "success" and s3["backlog_remaining"] is False, s3
    assert news_db.drifted_posts() == 0
    assert s1["posts_reconciled"] + s3["posts_reconciled"] == 60  # nothing read twice
    assert news_db.one("SELECT count(*) FROM pin_nightly.news_drift") == 20
    assert news_db.q("SELECT scope, status FROM pin_nightly.sweep WHERE scope = 'FullSweep'") == [
        ("FullSweep", "done")
    ]


def test_news_skipped_posts_are_forgotten_once_a_completed_sweep_covered_them(news_db):
    import psycopg

    archived = news_db.post(count=5, visible=2, status="Archived")
    fixed_outside = news_db.post(count=2, visible=2)
    still_locked = news_db.post(count=5, visible=2)
    news_db.q("CREATE SCHEMA IF NOT EXISTS pin_nightly")
    run_dag(NEWS, {"post_ids": [fixed_outside], "dry_run": True})  # creates the job's tables
    news_db.q(
        "INSERT INTO pin_nightly.news_skipped_post (post_id, skipped_at) "
        "SELECT unnest(%s::uuid[]), now() - interval '1 day'",
        [archived, fixed_outside, still_locked],
    )
    hot_path = psycopg.connect(news_db.dsn)
    hot_path.execute("SELECT 1 FROM news.posts WHERE id = %s FOR UPDATE", (still_locked,))
    try:
        s = run_dag(NEWS, {"scope": "DailyWindow"})["summary"]
    finally:
        hot_path.rollback()
        hot_path.close()
    assert s["status"] == "success" and s["posts_skipped_locked"] == 1
    assert news_db.q("SELECT post_id::text FROM pin_nightly.news_skipped_post") == [(still_locked,)]
    run_dag(NEWS, {"scope": "DailyWindow"})
    assert news_db.q("SELECT count(*) FROM pin_nightly.news_skipped_post") == [(0,)]
    assert news_db.count(still_locked) == 2 and news_db.count(archived) == 5


def test_catalog_growth_across_a_missed_night_at_the_window_edge_is_scored(catalog_db):
    card = catalog_db.card(views=200)
    catalog_db.seed_snapshot(card, D - timedelta(days=31), 100)
    catalog_db.seed_snapshot(card, D - timedelta(days=29), 200)  # D-30 missed
    catalog_db.set_today(D)
    s = run_dag(CATALOG, {}, logical_date=night(D), run_after=night(D))["summary"]
    assert s["status"] == "success"
    # the growth of 100 belongs to night D-29, inside the window: 100 * 2^(-29/7)
    assert str(catalog_db.score(card)) == "5.6608"


def test_catalog_a_manual_run_with_a_small_window_keeps_the_nightly_history(catalog_db):
    card = catalog_db.card(views=1000)
    history = {D - timedelta(days=age): 1000 - 20 * age for age in range(40, 0, -1)}
    for d, v in history.items():
        catalog_db.seed_snapshot(card, d, v)
    catalog_db.set_today(D)
    s = run_dag(CATALOG, {"window_days": 4}, logical_date=night(D), run_after=night(D))["summary"]
    assert s["status"] == "success"
    kept = [d for d, _ in catalog_db.snapshots(card)]
    assert min(kept) == D - timedelta(days=W + 2)  # the nightly window's horizon, not 4 + 2
    assert s["snapshots_pruned"] == 40 - (W + 2)
    catalog_db.set_views(card, 1050)
    nxt = D + timedelta(days=1)
    catalog_db.set_today(nxt)
    assert run_dag(CATALOG, {}, logical_date=night(nxt), run_after=night(nxt))["state"] == "success"
    full = {**history, D: 1000, nxt: 1050}
    assert catalog_db.score(card) == reference_popularity_score(full, nxt, W, H)


# ================================================================================== news


def news_offsets(db) -> dict[str, int]:
    return dict(
        db.q(
            "SELECT p.id::text, p.comments_count - (SELECT count(*) FROM news.comments c "
            "WHERE c.post_id = p.id AND c.status = 'Visible') FROM news.posts p"
        )
    )


def news_invariants(
    db, r: dict, expect_fixed: set[str], drift: dict[str, int], expect_open: bool
) -> None:
    """The database after a recovery run ``r``; ``expect_open``: a sweep must be left for the
    next run (and the result must say so), else no sweep may be open at all."""
    offsets = news_offsets(db)
    want = {p: (0 if p in expect_fixed else drift.get(p, 0)) for p in offsets}
    assert offsets == want, {p: (offsets[p], want[p]) for p in offsets if offsets[p] != want[p]}
    corrections = db.q(
        "SELECT post_id::text, count_from - count_to FROM pin_nightly.news_drift WHERE NOT dry_run"
    )
    assert len(corrections) == len({p for p, _ in corrections}), "a post corrected twice"
    assert dict(corrections) == {p: drift[p] for p in expect_fixed}
    state_invariants(db, r, expect_open)


NEWS_CONF = {"scope": "FullSweep", "batch_size": 4, "max_ranges": 2}
SATURDAY = datetime(2026, 11, 28, 0, 0, tzinfo=UTC)  # 03:00 Moscow
MONDAY = datetime(2026, 11, 30, 0, 0, tzinfo=UTC)  # auto = DailyWindow

NEWS_POINTS = {
    "validate_options": ("pin_nightly.news.validate_options", "before"),
    "acquire_lease": ("pin_nightly.lease.acquire", "after"),
    "plan_ranges": ("pin_nightly.runs.plan", "after"),
    "range_mid_batch": ("pin_nightly.news.make_batch", "mid_batch"),
    "range_before_return": ("pin_nightly.ranges.run_range", "after"),
    "summarize": ("pin_nightly.runs.summarize", "before"),
    "release_lease": ("pin_nightly.runs.teardown", "before"),
}
NEWS_CLASSES = {
    "nothing written": ["validate_options", "acquire_lease"],
    # the failed run's FullSweep exists (the next run of any scope resumes it) with ranges
    # left undone (a run that does only its own work leaves it open)
    "sweep unfinished": ["plan_ranges", "range_mid_batch"],
    "ranges done, not summarized": ["range_before_return", "summarize"],
    "lease not released": ["release_lease"],
}
NEWS_SWEEP_UNFINISHED = set(NEWS_CLASSES["sweep unfinished"])
NEWS_SWEEP_OPENED = set(NEWS_POINTS) - set(NEWS_CLASSES["nothing written"])


def news_data(db):
    """24 quiet posts, every third drifted (only a FullSweep reaches them), and 3 drifted
    posts with comment activity two hours ago (a DailyWindow reaches them too)."""
    now = datetime.now(UTC)
    quiet = db.posts(24, drift_every=3)
    recent = [
        db.post(count=4 + i, visible=2, comments_at=now - timedelta(hours=2)) for i in range(3)
    ]
    drift = {p: o for p, o in news_offsets(db).items() if o}
    assert len(drift) == 11
    return quiet, recent, drift


@pytest.mark.parametrize("point,recovery", matrix(NEWS, NEWS_CLASSES))
def test_news_fault_matrix(news_db, monkeypatch, failed_runs, point, recovery):
    def failed_run():
        data = news_data(news_db)
        how = NEWS_POINTS[point]
        return data, fail_once(monkeypatch, NEWS, point, *how, None, NEWS_CONF, SATURDAY)

    (quiet, recent, drift), failed = failed_runs.get(news_db, (NEWS, point), failed_run)
    targets = sorted(drift)[:2]
    manual = {
        "dry_run": {"scope": "FullSweep", "dry_run": True},
        "targeted": {"post_ids": targets},
        "other_window": {"scope": "DailyWindow"},
    }
    done_by_failed = {p for p, o in news_offsets(news_db).items() if p in drift and not o}
    r = recover(NEWS, recovery, failed, NEWS_CONF, MONDAY, manual)
    assert r["state"] == "success", (point, recovery, r["tasks"])
    if recovery.startswith("clear_"):
        assert r["run_id"] == failed["run_id"]
        expect = set(drift)
    elif recovery == "dry_run":
        expect = done_by_failed
        assert r["summary"]["drift_found"] == len(drift) - len(done_by_failed)
    elif recovery == "targeted":
        expect = done_by_failed | set(targets)
    elif point in NEWS_SWEEP_OPENED:  # the next run resumes the failed run's FullSweep
        expect = set(drift)
    else:  # nothing was started: a DailyWindow reaches the recent drift only
        expect = done_by_failed | (set(recent) & set(drift))
    left_open = recovery in ("dry_run", "targeted") and point in NEWS_SWEEP_UNFINISHED
    news_invariants(news_db, r, expect, drift, expect_open=left_open)
    if recovery == "next_night" or recovery == "other_window":
        assert r["summary"]["scope"] == "DailyWindow"


# =============================================================================== catalog

D = date(2026, 8, 29)  # as_of_date of the failed run (a Saturday, in the past)
W, H = 30, 7


CATALOG_CONF = {"batch_size": 2, "max_ranges": 2}
CATALOG_POINTS = {
    "validate_options": ("pin_nightly.catalog.validate_options", "before", None),
    "acquire_lease": ("pin_nightly.lease.acquire", "after", None),
    "plan_property_objects": ("pin_nightly.runs.plan", "after", None),
    "property_objects_mid_batch": ("pin_nightly.catalog.make_batch", "mid_batch", "PropertyObject"),
    "range_before_return": ("pin_nightly.ranges.run_range", "after", None),
    "projects_mid_batch": ("pin_nightly.catalog.make_batch", "mid_batch", "Project"),
    "retention": ("pin_nightly.catalog.retention", "before", None),
    "summarize": ("pin_nightly.runs.summarize", "before", None),
    "release_lease": ("pin_nightly.runs.teardown", "before", None),
}
CATALOG_CLASSES = {
    "nothing written": ["validate_options", "acquire_lease"],
    # a pass of the failed run's date with ranges undone
    "pass unfinished": [
        "plan_property_objects",
        "property_objects_mid_batch",
        "projects_mid_batch",
    ],
    "passes done, not finished": ["range_before_return", "retention", "summarize"],
    "lease not released": ["release_lease"],
}
CATALOG_SWEEP_UNFINISHED = set(CATALOG_CLASSES["pass unfinished"])


def catalog_data(db) -> dict[str, dict]:
    """9 property-object and 3 project cards, each with 37 nights of snapshot history (a night
    missed now and then), a score that agrees with it, and a counter that grew since."""
    import random

    from tools.devenv import run_sql_file

    run_sql_file(db.dsn, "schema/catalog_popularity.sql")
    rnd = random.Random(7)
    cards = {}
    for i in range(12):
        kind = "Project" if i % 4 == 0 else "PropertyObject"
        views, history = rnd.randint(0, 200), {}
        for age in range(37, 0, -1):
            views += rnd.choice((0, 1, 5, 20, 90))
            if rnd.random() < 0.85:
                history[D - timedelta(days=age)] = views
        now = views + rnd.randint(1, 60)
        score = reference_popularity_score(history, max(history), W, H)
        cid = db.card(views=now, kind=kind, score=score)
        for d, v in history.items():
            db.seed_snapshot(cid, d, v, kind=kind)
        cards[cid] = {"kind": kind, "views": now, "history": history}
    return cards


def catalog_invariants(
    db,
    r: dict,
    cards: dict,
    complete: date | None,
    targets: set[str],
    window: int,
    expect_open: bool,
    pruned_as_of: date | None = None,
) -> None:
    """Every card's score is the formula over its true history at its newest snapshot date;
    no snapshot a later night needs is gone (counted back from the newest snapshot, or from
    ``pruned_as_of``, a date whose retention ran, when later); ``complete``: the date every
    card (or only ``targets``) must have a snapshot of."""
    newest_run = db.one("SELECT max(run_date) FROM catalog.popularity_daily_views")
    newest_run = max(filter(None, [newest_run, pruned_as_of]))
    for cid, c in cards.items():
        stored = dict(db.snapshots(cid))
        written = {d: v for d, v in stored.items() if d >= D}
        assert all(v == c["views"] for v in written.values()), (cid, written)
        history = {**c["history"], **written}
        for d, v in c["history"].items():  # the seeded history a later night still reads
            if d >= newest_run - timedelta(days=W + 2):
                assert stored.get(d) == v, (cid, d, "snapshot lost")
        newest = max(stored)
        w = window if newest > D and (not targets or cid in targets) else W
        assert db.score(cid, c["kind"]) == reference_popularity_score(history, newest, w, H), (
            cid,
            newest,
            w,
        )
        if complete is not None and (not targets or cid in targets):
            assert complete in stored, (cid, complete)
    state_invariants(db, r, expect_open)


@pytest.mark.parametrize("point,recovery", matrix(CATALOG, CATALOG_CLASSES))
def test_catalog_fault_matrix(catalog_db, monkeypatch, failed_runs, point, recovery):
    # the failed night D, and its recoveries, happen on day D + 1 (the job's clock: D is
    # yesterday's night; a copy of the database does not keep the setting)
    catalog_db.set_today(D + timedelta(days=1))

    def failed_run():
        data = catalog_data(catalog_db)
        how = CATALOG_POINTS[point]
        return data, fail_once(monkeypatch, CATALOG, point, *how, CATALOG_CONF, night(D))

    cards, failed = failed_runs.get(catalog_db, (CATALOG, point), failed_run)
    catalog_db.set_today(D + timedelta(days=1))
    targets = sorted(cards)[:3]
    later = night(D + timedelta(days=1))
    manual = {
        "dry_run": {"dry_run": True},
        "targeted": {"card_ids": targets},
        "other_window": {"window_days": 4},
    }
    if recovery in manual:  # manual runs about the next date (their run-after instant)
        r = run_dag(
            CATALOG,
            manual[recovery],
            logical_date=later + timedelta(hours=1),
            run_after=later + timedelta(hours=1),
        )
    else:
        r = recover(CATALOG, recovery, failed, CATALOG_CONF, later, manual)
    assert r["state"] == "success", (point, recovery, r["tasks"])
    complete = {
        "clear_failed": D,
        "clear_task": D,
        "clear_run": D,
        "next_night": later.date(),
        "other_window": later.date(),
        "targeted": later.date(),
    }.get(recovery)
    catalog_invariants(
        catalog_db,
        r,
        cards,
        complete,
        set(targets) if recovery == "targeted" else set(),
        window=4 if recovery == "other_window" else W,
        # a dry, targeted or other-formula run leaves the nightly's unfinished pass to it
        expect_open=recovery in ("dry_run", "targeted", "other_window")
        and point in CATALOG_SWEEP_UNFINISHED,
        # the failed run's retention ran after its failure (all_done): its horizon counts
        pruned_as_of=D if failed["tasks"].get("retention") == "success" else None,
    )


def test_the_fault_classes_cover_every_failure_point():
    assert sorted(p for ps in NEWS_CLASSES.values() for p in ps) == sorted(NEWS_POINTS)
    assert sorted(p for ps in CATALOG_CLASSES.values() for p in ps) == sorted(CATALOG_POINTS)
