"""Every card and every post of the window is reached within a bounded number of nights however
a night ends early (its budget, the graceful stop, a failure) and however many ranges it runs;
retention runs every night; no growth is dated on the wrong night (a late clear, a backfill).
On a real PostgreSQL through the real DAGs (``dag.test()``); the bounds are in
docs/design.md ("No starvation")."""

from __future__ import annotations

import functools
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from pin_nightly import ranges
from tests.helpers import (
    InjectedFault,
    assert_ok,
    failed_tasks,
    inject,
    night,
    reference_popularity_score,
    run_night,
)
from tools.rundag import clear_and_resume, return_values, run_dag

CATALOG = "catalog_popularity_recompute"
NEWS = "news_comment_reconcile"
H = 7


def graceful_stop_after(monkeypatch, db, batches: int, kind: str | None = None) -> dict:
    """The runbook's graceful stop (``run_deadline_at = now()``), made after ``batches`` batches
    of card kind ``kind`` (any kind, or news, when None) of each run: once the batch has
    committed, so that no batch waits for it. Returns the count of batches that read rows."""
    real = ranges._Range.batch
    seen = {"batches": 0}

    @functools.wraps(real)
    def batch(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        worked = out[0] is not None and out[0].last_id is not None
        if worked and kind in (None, getattr(self.job, "kind", None)):
            seen["batches"] += 1
            if seen["batches"] == batches:
                db.q("UPDATE pin_nightly.job_lease SET run_deadline_at = now()")
        return out

    monkeypatch.setattr(ranges._Range, "batch", batch)
    return seen


def fail_each_range_at(monkeypatch, batch_no: int) -> None:
    """Every popularity range task fails inside its ``batch_no``-th batch (rolled back): each
    range is cut after ``batch_no - 1`` batches, as when several ranges run at once and the
    night ends (the workers lost)."""
    from pin_nightly import catalog

    real = catalog.make_batch

    def make_batch(*args, **kwargs):
        job = real(*args, **kwargs)
        calls, batch = [0], job.batch

        def failing(cur, *a):
            calls[0] += 1
            if calls[0] == batch_no:
                raise InjectedFault("worker lost with its range half done")
            return batch(cur, *a)

        job.batch = failing
        return job

    monkeypatch.setattr(catalog, "make_batch", make_batch)


def newest_snapshots(db, cards) -> dict:
    rows = db.q(
        "SELECT card_id::text, max(run_date) FROM catalog.popularity_daily_views GROUP BY 1"
    )
    newest = dict(rows)
    return {c: newest.get(c) for c in cards}


def assert_exact(db, cards: dict, d) -> None:
    """Every card reached on night ``d`` has exactly the reference score as of ``d``."""
    for cid, kind in cards.items():
        snaps = dict(db.snapshots(cid))
        if d in snaps:
            assert db.score(cid, kind) == reference_popularity_score(snaps, d, 30, H), cid


def test_every_range_cut_at_once_goes_on_from_its_own_cursor(catalog_db, monkeypatch):
    """Four ranges cut half-way at once (as with four pool slots): the next night takes the
    four tails first, not the first range's tail and then the other ranges from their starts
    (which left the tails of ranges 2 to 4 unreached, night after night)."""
    db = catalog_db
    d = db.today() - timedelta(days=1)
    cards = {db.card(views=10 * i): "PropertyObject" for i in range(32)}
    conf = {"batch_size": 2, "max_ranges": 4}
    with monkeypatch.context() as mp:
        fail_each_range_at(mp, 3)  # 2 batches of 4 per range: half of each range
        first = run_night(CATALOG, conf, d)
    assert first["state"] == "failed"
    reached = {c for c, n in newest_snapshots(db, cards).items() if n == d}
    assert len(reached) == 16
    db.q("UPDATE catalog.property_object_cards SET popularity_views = popularity_views + 5")
    # tonight's budget covers 8 batches: exactly the 16 cards the cut night left
    seen = graceful_stop_after(monkeypatch, db, 8, "PropertyObject")
    s = assert_ok(run_night(CATALOG, conf, d + timedelta(days=1)))
    assert seen["batches"] == 8 and s["status"] == "backlog_remaining"
    tonight = {c for c, n in newest_snapshots(db, cards).items() if n == d + timedelta(days=1)}
    assert tonight == set(cards) - reached, "the tails of the cut ranges went first"
    assert_exact(db, cards, d + timedelta(days=1))


@pytest.mark.long
def test_a_pass_cut_inside_one_range_every_night_still_reaches_the_next_ranges(
    catalog_db, monkeypatch
):
    """One slot, a budget smaller than one range: each night goes on where the last stopped
    and reaches the ranges after it (before, the range it stopped in was worked again from its
    start, and the ranges after it were never reached)."""
    db = catalog_db
    d0 = db.today() - timedelta(days=6)
    cards = {db.card(views=i): "PropertyObject" for i in range(24)}
    conf = {"batch_size": 2, "max_ranges": 2}  # 2 ranges of 6 batches; 4 batches a night
    nights = []
    for k in range(6):
        d = d0 + timedelta(days=k)
        db.q("UPDATE catalog.property_object_cards SET popularity_views = popularity_views + 3")
        with monkeypatch.context() as mp:
            graceful_stop_after(mp, db, 4, "PropertyObject")
            assert_ok(run_night(CATALOG, conf, d))
        nights.append(d)
        assert_exact(db, cards, d)
    # 8 cards a night: every card within every 3 consecutive nights
    for k in range(2, 6):
        snaps = db.q(
            "SELECT DISTINCT card_id::text FROM catalog.popularity_daily_views "
            "WHERE run_date BETWEEN %s AND %s",
            nights[k - 2],
            nights[k],
        )
        assert {c for (c,) in snaps} == set(cards), nights[k]


@pytest.mark.long
def test_a_graceful_stop_in_the_first_pass_every_night_does_not_starve_the_second(
    catalog_db, monkeypatch
):
    """Stopped every night after half of the property-object cards: the projects pass goes
    first on the night after one that did not finish it, so both kinds are reached every two
    nights (before, no project card ever got a snapshot)."""
    db = catalog_db
    d0 = db.today() - timedelta(days=4)
    cards = {db.card(views=i): "PropertyObject" for i in range(8)}
    cards |= {db.card(views=i, kind="Project"): "Project" for i in range(4)}
    conf = {"batch_size": 2, "max_ranges": 1}
    for k in range(5):
        d = d0 + timedelta(days=k)
        for table in db.TABLES.values():
            db.q(f"UPDATE {table} SET popularity_views = popularity_views + 2")
        with monkeypatch.context() as mp:
            graceful_stop_after(mp, db, 2, "PropertyObject")  # 4 of the 8 cards
            r = run_night(CATALOG, conf, d)
        assert_ok(r)
        first = db.one(
            "SELECT family FROM pin_nightly.sweep WHERE scope LIKE %s ORDER BY sweep_id LIMIT 1",
            f"%@{d}",
        )
        # the passes alternate: the one the cut left behind goes first the next night
        assert first == ("Project" if k % 2 else "PropertyObject"), (d, first)
        assert_exact(db, cards, d)
        newest = newest_snapshots(db, cards)
        if k >= 1:
            stale = [c for c, n in newest.items() if n is None or n < d - timedelta(days=1)]
            assert stale == [], (d, stale)
    projects = [c for c, kind in cards.items() if kind == "Project"]
    assert all(len(db.snapshots(c)) >= 2 for c in projects)


def test_retention_deletes_the_oldest_night_when_the_passes_use_the_whole_budget(
    catalog_db, monkeypatch
):
    """A night whose passes end at the deadline still prunes: the oldest night past the
    horizon goes (the table never grows by more than a night), and every night a later
    score reads stays."""
    db = catalog_db
    d = db.today() - timedelta(days=1)
    card = db.card(views=100)
    for back in range(1, 36):  # 35 nights of history, 3 past the horizon of 32
        db.seed_snapshot(card, d - timedelta(days=back), 100 - back)
    with monkeypatch.context() as mp:
        graceful_stop_after(mp, db, 1)
        s = assert_ok(run_night(CATALOG, {"batch_size": 5}, d))
    assert s["snapshots_pruned"] == 1
    kept = [k for k, _ in db.snapshots(card)]
    assert min(kept) == d - timedelta(days=34) and len(kept) == 35  # 34 seeded + tonight's
    s = assert_ok(run_night(CATALOG, {"batch_size": 5}, d))
    assert s["snapshots_pruned"] == 2  # with time left, everything past the horizon
    assert min(k for k, _ in db.snapshots(card)) == d - timedelta(days=32)


def test_a_late_clear_of_an_old_range_whose_sweep_is_still_open_writes_nothing(
    catalog_db, monkeypatch
):
    """Night D fails in its first pass; night D+1 fails in its first pass (the projects, behind
    since D never planned them), so its second pass is never planned and the pass of D stays
    open under D's holder. Clearing D's failed range, as the runbook says, writes nothing: no
    snapshot dated D with today's counters."""
    db = catalog_db
    d = db.today() - timedelta(days=2)
    for _ in range(3):
        db.card(views=10)
        db.card(views=20, kind="Project")
    conf = {"batch_size": 1, "max_ranges": 1}
    with monkeypatch.context() as mp:
        inject(mp, "pin_nightly.catalog.make_batch", "mid_batch", "PropertyObject")
        night_d = run_night(CATALOG, conf, d)
    assert night_d["tasks"]["recompute_property_objects[0]"] == "failed", night_d["tasks"]
    with monkeypatch.context() as mp:
        inject(mp, "pin_nightly.catalog.make_batch", "mid_batch", "Project")
        nxt = run_night(CATALOG, conf, d + timedelta(days=1))
    assert nxt["tasks"]["recompute_property_objects[0]"] == "failed", nxt["tasks"]
    assert nxt["tasks"]["plan_projects"] == "upstream_failed", nxt["tasks"]
    scope = f"PropertyObject@{d}"
    assert db.one("SELECT status FROM pin_nightly.sweep WHERE scope = %s", scope) == "open"
    db.q("UPDATE catalog.property_object_cards SET popularity_views = popularity_views + 1000")
    before = db.q("SELECT card_id, run_date, cumulative_views FROM catalog.popularity_daily_views")
    r = clear_and_resume(
        CATALOG, night_d["run_id"], task_ids=failed_tasks(night_d), only_failed=False
    )
    assert r["state"] == "success", r["tasks"]
    after = db.q("SELECT card_id, run_date, cumulative_views FROM catalog.popularity_daily_views")
    assert sorted(after) == sorted(before)
    [done] = return_values(CATALOG, night_d["run_id"], "recompute_property_objects")
    assert done["status"] == "superseded", done
    assert done["superseded_by"].startswith("superseded by the run"), done
    assert r["summary"]["status"].startswith("nothing written: superseded by the run"), r


def test_a_catch_up_of_missed_nights_is_refused_whatever_its_run_type(
    catalog_db,
):
    """Nights D-3 to D-1 were missed (newest snapshot D-4). A run of any of them started today
    would stamp today's counters as that night's snapshots (four days of growth on one aged
    night, then zero deltas): a backfill, a manual run with the night as its logical date or a
    re-run of a stored night, each is refused before writing, saying why; yesterday's run goes
    on, and tonight's run carries the whole gap's growth."""
    db = catalog_db
    today = db.today()
    card = db.card(views=500)
    db.seed_snapshot(card, today - timedelta(days=4), 100)
    for back in (4, 3, 2):  # 4: a stored night
        day = night(today - timedelta(days=back))
        for run_id in (f"backfill__{day.isoformat()}", None):
            r = run_dag(CATALOG, {}, logical_date=day, run_id=run_id)
            assert r["state"] == "failed" and r["tasks"]["validate_options"] == "failed", r
            assert db.snapshots(card) == [(today - timedelta(days=4), 100)]
    # refused before any step, with its own message on a fresh install (no job table yet)
    assert db.one("SELECT to_regnamespace('pin_nightly') IS NULL")
    yesterday = today - timedelta(days=1)
    s = assert_ok(
        run_dag(
            CATALOG,
            {},
            logical_date=night(yesterday),
            run_id=f"backfill__{night(yesterday).isoformat()}",
        )
    )
    assert s["status"] == "success" and (yesterday, 500) in db.snapshots(card)
    # the whole gap's growth lands on the first night after it: 400 at age 0
    assert db.score(card) == Decimal("400.0000")


def test_a_news_backfill_before_yesterday_is_refused(news_db):
    db = news_db
    post = db.post(count=5, visible=2)
    day = night(db.today() - timedelta(days=3))
    r = run_dag(
        NEWS, {"scope": "FullSweep"}, logical_date=day, run_id=f"backfill__{day.isoformat()}"
    )
    assert r["state"] == "failed" and r["tasks"]["validate_options"] == "failed", r
    assert db.count(post) == 5  # nothing touched
    assert_ok(run_dag(NEWS, {"scope": "FullSweep"}, logical_date=day))  # a manual run goes on
    assert db.count(post) == 2


def test_an_unfinished_window_is_followed_by_one_that_starts_where_it_stopped(news_db, monkeypatch):
    """A DailyWindow cut by its budget night after night: the next window starts with the
    posts the cut one did not reach (the newest posts are not left for the weekly FullSweep)."""
    db = news_db
    posts = [db.post(count=0, visible=0) for _ in range(12)]
    conf = {"scope": "DailyWindow", "batch_size": 2, "max_ranges": 1}
    d = db.today() - timedelta(days=2)

    def drift_all():
        for p in posts:
            db.q(
                "INSERT INTO news.comments (id, post_id, status, created_at, updated_at) "
                "VALUES (gen_random_uuid(), %s, 'Visible', now(), now())",
                p,
            )

    drift_all()
    with monkeypatch.context() as mp:
        graceful_stop_after(mp, db, 3)  # 6 of the 12 posts
        s = assert_ok(run_dag(NEWS, conf, logical_date=night(d)))
    assert s["status"] == "backlog_remaining"
    fixed = {p for p in posts if db.count(p) == 1}
    assert len(fixed) == 6 and fixed == set(sorted(posts)[:6])
    with monkeypatch.context() as mp:
        graceful_stop_after(mp, db, 3)
        assert_ok(run_dag(NEWS, conf, logical_date=night(d + timedelta(days=1))))
    assert all(db.count(p) == 1 for p in posts), "the newest six went first"


def test_a_post_isolated_on_a_daily_window_night_is_taken_again_by_the_next_window(news_db):
    """A domain trigger rejects a post's correction on a DailyWindow night (it is isolated and
    recorded); the next night's DailyWindow takes it again although its comments are older
    than the window (before, only the next FullSweep did, up to a week later)."""
    db = news_db
    now = datetime.now(UTC)
    post = db.post(count=5, visible=2, comments_at=now)
    other = db.post(count=1, visible=1, comments_at=now)
    db.fail_updates_of(post, errcode="raise_exception")
    conf = {"scope": "DailyWindow"}
    d = db.today() - timedelta(days=1)
    s = assert_ok(run_dag(NEWS, conf, logical_date=night(d)))
    assert s["item_errors"] == 1 and db.count(post) == 5
    db.allow_updates()
    # a day later: the post's comments are older than the next window's lookback
    db.q(
        "UPDATE news.comments SET created_at = now() - interval '3 days', "
        "updated_at = now() - interval '3 days'"
    )
    s = assert_ok(run_dag(NEWS, conf, logical_date=night(d + timedelta(days=1))))
    assert db.count(post) == 2 and s["drift_corrected"] == 1, s
    assert db.count(other) == 1
