"""What the docs promise, on the paths where it was found not to hold: a catch-up never
misdates growth, a row that failed before is never held hostage by another, retention and the
summary run every night, a held post stays a window candidate until it is written. Each through
the real DAGs (``dag.test()``) on a real PostgreSQL; nights run "as of" their date through the
job's clock (docs/development.md)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from pin_nightly import catalog
from tests.helpers import (
    assert_ok,
    failed_tasks,
    inject,
    night,
    reference_popularity_score,
    run_night,
)
from tools.rundag import clear_and_resume, run_dag

NEWS = "news_comment_reconcile"
CATALOG = "catalog_popularity_recompute"
W, H = 30, 7


def snapshots_of(db) -> list[tuple]:
    return db.q(
        "SELECT card_id::text, run_date, cumulative_views FROM catalog.popularity_daily_views "
        "ORDER BY 1, 2"
    )


# --- a catch-up never misdates growth -------------------------------------------------------


def test_a_manual_run_of_a_missed_night_is_refused_and_tonight_carries_the_gap(catalog_db, capfd):
    """Nights D-3 .. D-1 were missed. An operator triggers them with their logical dates (the
    trigger form, ``airflow dags trigger -l``, REST): each is refused before writing, saying
    why; tonight's run puts the whole gap's growth on tonight, as the formula says."""
    db = catalog_db
    today = db.today() - timedelta(days=10)
    db.set_today(today)
    cards = [db.card(views=100 + 10 * i) for i in range(4)]
    for c in cards:
        db.seed_snapshot(c, today - timedelta(days=4), 50)
    for back in (3, 2):
        r = run_dag(CATALOG, {}, logical_date=night(today - timedelta(days=back)))
        assert r["state"] == "failed" and r["tasks"]["validate_options"] == "failed", r["tasks"]
        out = capfd.readouterr()
        assert f"night {today - timedelta(days=back)} is past" in out.out + out.err
    assert all(d == today - timedelta(days=4) for _, d, _ in snapshots_of(db))
    assert_ok(run_night(CATALOG, {}, today))
    for i, c in enumerate(cards):
        assert db.score(c) == reference_popularity_score(dict(db.snapshots(c)), today, W, H)
        assert db.score(c) == 50 + 10 * i  # the gap's growth at age 0


def test_a_clear_of_an_old_night_a_week_later_writes_nothing(catalog_db, monkeypatch, capfd):
    """Night D's property-object range fails; no night runs after it (an outage); a week later
    the on-call clears the failed range: the night is past by the job's clock, read at the
    write, so the range writes nothing and the run ends green saying why; no snapshot of D
    carries a week's growth."""
    db = catalog_db
    d = db.today() - timedelta(days=20)
    db.cards_seen_the_night_before(d, 6, views=100, seen=50)
    conf = {"batch_size": 2, "max_ranges": 1}
    with monkeypatch.context() as mp:
        inject(mp, "pin_nightly.catalog.make_batch", "mid_batch", "PropertyObject")
        failed = run_night(CATALOG, conf, d)
    assert failed["state"] == "failed", failed["tasks"]
    before = snapshots_of(db)
    db.q("UPDATE catalog.property_object_cards SET popularity_views = popularity_views + 700")
    db.set_today(d + timedelta(days=7))
    capfd.readouterr()
    r = clear_and_resume(CATALOG, failed["run_id"], task_ids=failed_tasks(failed))
    assert r["state"] == "success", r["tasks"]
    assert snapshots_of(db) == before
    out = capfd.readouterr()
    assert f"night {d} is past; tonight's run carries its growth" in out.out + out.err
    why = f"nothing written: night {d} is past; tonight's run carries its growth"
    assert r["summary"]["status"] == why, r["summary"]


# --- a held row is never held hostage ----------------------------------------------------------


def test_rows_that_failed_before_are_written_as_soon_as_what_rejected_them_is_gone(catalog_db):
    """A rule rejects every card on night D (each recorded); on night D+1 it rejects only one of
    them, the others unchanged since: the 39 are written (isolated by halves, as fresh rows
    are), the one still failing is not recorded again, and the run counts only it."""
    db = catalog_db
    d = db.today() - timedelta(days=5)
    cards = db.cards_seen_the_night_before(d, 40)
    db.reject_all_updates("catalog.property_object_cards")
    r = run_night(CATALOG, {"batch_size": 50}, d)
    assert r["tasks"]["summarize"] == "failed"  # most rows failed
    assert db.one("SELECT count(*) FROM pin_nightly.item_error") == 40
    db.allow_updates("catalog.property_object_cards")
    db.fail_updates_of(cards[17], "catalog.property_object_cards", errcode="check_violation")
    s = assert_ok(run_night(CATALOG, {"batch_size": 50}, d + timedelta(days=1)))
    assert s["item_errors"] == 1 and s["property_object_cards_updated"] == 39, s
    assert db.one("SELECT count(*) FROM pin_nightly.item_error") == 40  # not recorded again
    for c in cards:
        snaps = dict(db.snapshots(c))
        if c == cards[17]:
            assert d + timedelta(days=1) not in snaps and db.score(c) == 0
        else:
            expected = reference_popularity_score(snaps, d + timedelta(days=1), W, H)
            assert d + timedelta(days=1) in snaps and db.score(c) == expected > 0


# --- retention and the summary run every night -------------------------------------------------


def test_a_row_rejected_by_row_level_security_is_isolated(catalog_db):
    """An error outside the classic item classes that concerns one row (row-level security's
    42501, a trigger's own ERRCODE) is isolated like any item error: the others are written."""
    db = catalog_db
    d = db.today() - timedelta(days=3)
    cards = db.cards_seen_the_night_before(d, 8)
    db.q(
        "CREATE FUNCTION public.two_rules() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        f"IF NEW.id = '{cards[2]}' THEN RAISE EXCEPTION 'new row violates row-level security' "
        "USING ERRCODE = 'insufficient_privilege'; END IF; "
        f"IF NEW.id = '{cards[5]}' THEN RAISE EXCEPTION 'not now' USING ERRCODE = 'PN001'; "
        "END IF; RETURN NEW; END $$"
    )
    db.q(
        "CREATE TRIGGER two_rules BEFORE UPDATE ON catalog.property_object_cards "
        "FOR EACH ROW EXECUTE FUNCTION public.two_rules()"
    )
    s = assert_ok(run_night(CATALOG, {"batch_size": 8}, d))
    assert s["item_errors"] == 2 and s["property_object_cards_updated"] == 6, s
    assert sorted(db.q("SELECT sqlstate FROM pin_nightly.item_error")) == [("42501",), ("PN001",)]


def test_a_range_that_fails_for_the_whole_table_still_lets_retention_and_the_summary_run(
    catalog_db,
):
    """Every card update is refused with a permission error: it concerns the table, not a row,
    so the range fails; retention still drops the nights past the horizon and the summary
    still counts and logs the run, which is red."""
    db = catalog_db
    d = db.today() - timedelta(days=2)
    cards = [db.card(views=20 + i) for i in range(6)]
    for c in cards:
        for back in range(1, 40):
            db.seed_snapshot(c, d - timedelta(days=back), 10)
    db.reject_all_updates("catalog.property_object_cards", errcode="insufficient_privilege")
    r = run_night(CATALOG, {"batch_size": 3}, d)
    assert r["state"] == "failed", r["tasks"]
    assert r["tasks"]["recompute_property_objects[0]"] == "failed", r["tasks"]
    assert r["tasks"]["retention"] == "success" and r["tasks"]["summarize"] == "failed"
    assert db.one("SELECT min(run_date) FROM catalog.popularity_daily_views") >= d - timedelta(
        days=W + 2
    )
    [(status,)] = db.q("SELECT status FROM pin_nightly.run_log")
    assert status.startswith("tasks failed: "), status
    assert db.one("SELECT count(*) FROM pin_nightly.item_error") == 0  # not the rows' fault
    assert db.q("SELECT holder FROM pin_nightly.job_lease") == []


# --- a held post stays a candidate until it is written ----------------------------------------


def test_a_held_post_stays_a_window_candidate_until_it_is_written(news_db):
    """A domain trigger rejects a post's correction: recorded on the first night, held (not
    recorded again) on the next; days later, with no comment activity on it and its record
    older than any window, the rule is dropped: the next DailyWindow corrects it (before, it
    waited for the weekly FullSweep)."""
    db = news_db
    post = db.post(count=5, visible=2, comments_at=datetime.now(UTC))
    db.fail_updates_of(post, errcode="raise_exception")
    conf = {"scope": "DailyWindow"}
    d = db.today() - timedelta(days=4)
    s = assert_ok(run_dag(NEWS, conf, logical_date=night(d)))
    assert s["item_errors"] == 1 and db.count(post) == 5
    s = assert_ok(run_dag(NEWS, conf, logical_date=night(d + timedelta(days=1))))
    assert s["item_errors"] == 1 and db.one("SELECT count(*) FROM pin_nightly.item_error") == 1
    # days pass: the record and the comments are older than any window
    db.q("UPDATE pin_nightly.item_error SET recorded_at = recorded_at - interval '5 days'")
    db.q(
        "UPDATE news.comments SET created_at = now() - interval '5 days', "
        "updated_at = now() - interval '5 days'"
    )
    db.allow_updates()
    s = assert_ok(run_dag(NEWS, conf, logical_date=night(d + timedelta(days=2))))
    assert db.count(post) == 2 and s["drift_corrected"] == 1, s


# --- a variant-formula run never takes the nightly's place -------------------------------------


def test_a_run_with_another_formula_leaves_the_nightly_coverage_order_alone(
    catalog_db, monkeypatch
):
    """Night D is cut after two batches (4 of 12 cards); a manual run of D with another window
    completes its own pass; night D+1, cut the same way, goes on with the 4 cards the nightly
    pass of D left next, not from the first card again (the variant's pass neither abandons
    the nightly's nor becomes the one the nightly's rotation starts from)."""
    from tests.test_coverage import graceful_stop_after

    db = catalog_db
    d = db.today() - timedelta(days=6)
    cards = sorted(db.card(views=10 + i) for i in range(12))
    conf = {"batch_size": 2, "max_ranges": 1}
    with monkeypatch.context() as mp:
        graceful_stop_after(mp, db, 2, "PropertyObject")
        assert_ok(run_night(CATALOG, conf, d))
    reached_d = {c for c, day, _ in snapshots_of(db) if day == d}
    assert reached_d == set(cards[:4])
    assert_ok(run_dag(CATALOG, {**conf, "window_days": 10}, logical_date=night(d)))
    with monkeypatch.context() as mp:
        graceful_stop_after(mp, db, 2, "PropertyObject")
        assert_ok(run_night(CATALOG, conf, d + timedelta(days=1)))
    reached = {c for c, day, _ in snapshots_of(db) if day == d + timedelta(days=1)}
    assert reached == set(cards[4:8]), [cards.index(c) for c in sorted(reached)]


# --- smaller promises ----------------------------------------------------------------------------


def test_a_planning_task_whose_lease_was_lost_opens_no_sweep(catalog_db):
    """Planning opens, adopts and abandons sweeps under the lease's fence, as a batch writes:
    a task whose lease expired or was taken over changes no sweep."""
    from pin_nightly import catalog, jobs, sweeps
    from pin_nightly import lease as leases
    from pin_nightly.db import connection

    db = catalog_db
    db.card(views=5)
    with connection("catalog_db") as conn:
        jobs.preflight(conn, catalog.JOB)
        lease = leases.acquire(conn, catalog.JOB.lock_key, "test/fenced", 10, 5)
    db.q("UPDATE pin_nightly.job_lease SET expires_at = clock_timestamp() - interval '1 s'")
    spec = sweeps.SweepSpec(job=catalog.JOB.code, family="PropertyObject", as_of_date="2026-12-01")
    with connection("catalog_db") as conn, pytest.raises(leases.LeaseLost):
        sweeps.open_sweep(conn, spec, lease, "test", lambda cur, s: (0, []))
    assert db.q("SELECT count(*) FROM pin_nightly.sweep") == [(0,)]


def test_a_late_summary_of_a_night_that_wrote_keeps_its_status(catalog_db):
    """Night D and night D+1 complete; then D's summary is cleared and runs again: D's run
    wrote its night, and its logged status stays what it did, not "nothing written"."""
    db = catalog_db
    d = db.today() - timedelta(days=3)
    for i in range(4):
        db.card(views=10 + i)
    night_d = assert_ok(run_night(CATALOG, {}, d))
    assert night_d["status"] == "success"
    assert_ok(run_night(CATALOG, {}, d + timedelta(days=1)))
    q = "SELECT status, result ->> 'duration_ms' FROM pin_nightly.run_log WHERE run_id = %s"
    [(before, duration)] = db.q(q, night_d["run_id"])
    r = clear_and_resume(CATALOG, night_d["run_id"], task_ids=["summarize"], only_failed=False)
    assert r["state"] == "success", r["tasks"]
    [(status, _)] = db.q(q, night_d["run_id"])
    assert status == before == "success", status
    assert 0 <= int(duration) < 600_000  # the database's clock on both ends


def test_a_paused_sweep_writes_nothing_not_even_the_rows_it_takes_first(catalog_db):
    """Night D's pass stops at its budget with a card it found locked remembered; an operator
    pauses the open pass; a run of D adopts it: while paused it writes nothing, not even the
    remembered card a range takes before its batches, and it holds no lock."""
    from pin_nightly import controls
    from pin_nightly.db import connection
    from tests.helpers import budget_spent_after_each_batch

    db = catalog_db
    d = db.today() - timedelta(days=2)
    db.set_today(d)
    cards = sorted(db.card(views=10 + i) for i in range(6))
    hot = psycopg.connect(db.dsn)
    hot.execute("SELECT 1 FROM catalog.property_object_cards WHERE id = %s FOR UPDATE", (cards[1],))
    conf = {"batch_size": 2, "max_ranges": 1}
    with budget_spent_after_each_batch(db):
        first = assert_ok(run_night(CATALOG, conf, d))
    hot.rollback()
    hot.close()
    assert first["status"] == "backlog_remaining", first
    assert db.q("SELECT card_id::text FROM pin_nightly.popularity_skipped_card") == [(cards[1],)]
    sweep = db.one(
        "SELECT sweep_id FROM pin_nightly.sweep WHERE status = 'open' AND family = 'PropertyObject'"
    )
    with connection("catalog_db") as conn:
        controls.give(conn, catalog.JOB, sweep, "pause", "anna", {})
    before = snapshots_of(db)
    stalled = run_dag(
        CATALOG,
        {**conf, "max_run_duration_minutes": 0.05},
        logical_date=night(d) + timedelta(hours=1),
    )
    assert stalled["state"] == "success", stalled["tasks"]
    assert [s for s in snapshots_of(db) if s[0] in cards and s[1] == d] == [
        s for s in before if s[0] in cards and s[1] == d
    ], "a paused sweep wrote a card"
    assert db.q("SELECT card_id::text FROM pin_nightly.popularity_skipped_card") == [(cards[1],)]
