"""Sequences of operations a data team and the platform produce, on a real PostgreSQL through
the real DAGs: two deployments on one cron slot, a run dated in the future, a late clear of an
older run after newer nights ran. Each ends with the data exact and the status honest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from pin_nightly.db import sql
from tests.conftest import SUFFIX
from tests.helpers import (
    ADVISORY_KEY,
    assert_ok,
    budget_spent_after_each_batch,
    failed_tasks,
    night,
    reference_popularity_score,
    run_night,
    when,
)
from tools.devenv import REPO, run_sql_file
from tools.rundag import clear_and_resume, run_dag

NEWS = "news_comment_reconcile"
CATALOG = "catalog_popularity_recompute"
W, H = 30, 7


def second_deployment(dag_id: str, conf: dict, run_id: str, logical_date) -> dict:
    """The same DAG run (same run id) in another Airflow: its own metadata database, the same
    jobs database, as a blue/green twin or a staging Airflow pointed at production would."""
    home = REPO / ".airflow" / f"second{SUFFIX}"
    out = subprocess.run(
        [sys.executable, "-m", "tools.rundag", dag_id, "--home", str(home)]
        + ["--conf", json.dumps(conf), "--run-id", run_id]
        + ["--logical-date", logical_date.isoformat()],
        cwd=REPO,
        env=os.environ.copy(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "log": out.stdout + out.stderr}


def gate_sweep_creation(dsn: str) -> psycopg.Connection:
    """Hold every run that opens a sweep at that point (a trigger waits for an advisory lock
    the returned session holds): the run has its lease and has written nothing yet. The wait
    is not cut by the job's ``lock_timeout`` (30 s): the other deployment's whole run, a
    fresh Airflow in a subprocess, happens while it waits."""
    run_sql_file(dsn, "schema/pin_nightly.sql")
    gate = psycopg.connect(dsn, autocommit=True)
    gate.execute(
        "CREATE OR REPLACE FUNCTION public.pin_test_sweep_gate() RETURNS trigger "
        "LANGUAGE plpgsql SET lock_timeout = '5min' "
        f"AS $$ BEGIN PERFORM pg_advisory_xact_lock({ADVISORY_KEY}); "
        "RETURN NEW; END $$"
    )
    gate.execute(
        "CREATE TRIGGER pin_test_sweep_gate BEFORE INSERT ON pin_nightly.sweep "
        "FOR EACH ROW EXECUTE FUNCTION public.pin_test_sweep_gate()"
    )
    gate.execute("SELECT pg_advisory_lock(%s)", (ADVISORY_KEY,))
    return gate


def lift_gate(gate: psycopg.Connection) -> None:
    gate.execute("SELECT pg_advisory_unlock(%s)", (ADVISORY_KEY,))
    gate.execute("DROP TRIGGER IF EXISTS pin_test_sweep_gate ON pin_nightly.sweep")
    gate.close()


def waiting_at_gate(db) -> bool:
    return bool(
        db.q(
            "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND objid = %s",
            ADVISORY_KEY,
        )
    )


# --- two deployments fire the same cron slot ---------------------------------------------------


@pytest.mark.long
@pytest.mark.parametrize("dag_id", [NEWS, CATALOG])
def test_two_deployments_on_one_slot_one_works_the_other_is_skipped(dag_id, news_db, catalog_db):
    """Both runs are named ``scheduled__<slot>``. The second finds the lease held while the first
    works: it logs ``skipped, lock held`` and ends green at once; the first is not disturbed
    (no LeaseLost), finishes its work, and its result is the run log's row of that run id."""
    d = catalog_db.today() - timedelta(days=1)
    slot = night(d)
    run_id = f"scheduled__{slot.isoformat()}"
    if dag_id == NEWS:
        db, conf = news_db, {"scope": "FullSweep", "batch_size": 3}
        db.posts(12, drift_every=2)
    else:
        db, conf = catalog_db, {"batch_size": 3}
        cards = [db.card(views=10 * i) for i in range(6)]
        for c in cards:
            db.seed_snapshot(c, d - timedelta(days=1), 1)
    gate = gate_sweep_creation(db.dsn)
    second: dict = {}

    def run_second():
        second.update(second_deployment(dag_id, conf, run_id, slot))
        lift_gate(gate)

    t = when(lambda: waiting_at_gate(db), run_second, timeout=120)
    try:
        first = run_dag(dag_id, conf, logical_date=slot, run_id=run_id)
    finally:
        t.join(300)
    assert second, "the second deployment did not run"
    assert second["run_id"] == first["run_id"] == run_id
    assert second["state"] == "success", second["tasks"]
    assert second["summary"]["status"] == "skipped, lock held"
    assert "skipped, lock held" in second["log"]
    s = assert_ok(first)
    assert s["status"] == "success", s
    if dag_id == NEWS:
        assert db.drifted_posts() == 0 and s["drift_corrected"] == 6
    else:
        for c in cards:
            assert db.snapshots(c)[-1][0] == d
            assert db.score(c) == reference_popularity_score(dict(db.snapshots(c)), d, W, H)
    assert db.q("SELECT count(*) FROM pin_nightly.job_lease") == [(0,)]
    logged = db.q("SELECT status FROM pin_nightly.run_log WHERE run_id = %s", run_id)
    assert logged == [("success",)]
    owners = {o for (o,) in db.q("SELECT DISTINCT owner FROM pin_nightly.sweep")}
    assert len(owners) == 1 and owners.pop().startswith(f"{dag_id}/{run_id} ~")


def test_the_second_deployment_never_releases_the_first_ones_lease(news_db):
    """A release removes only its own acquisition: the teardown of a run with the same run id
    from another deployment leaves the working run's lease in place."""
    from pin_nightly import jobs, news, runs

    opts = news.validate_options({}, night(news_db.today()))
    other = {**opts, "run_tag": jobs.run_tag()}
    held = jobs.acquire_lease(news.JOB, opts, "scheduled__x")
    refused = jobs.acquire_lease(news.JOB, other, "scheduled__x")
    assert held["acquired"] and refused == {
        "acquired": False,
        "holder": held["holder"],
        "expires_at": refused["expires_at"],
    }
    forged = {**held, "holder": news.JOB.holder(other, "scheduled__x")}
    assert runs.release_lease(runs.Run.of(news.JOB, {}, "", forged)) is False
    assert news_db.q("SELECT holder, token FROM pin_nightly.job_lease") == [
        (held["holder"], held["token"])
    ]
    assert runs.release_lease(runs.Run.of(news.JOB, {}, "", held)) is True


# --- a run dated in the future ----------------------------------------------------------------


def test_a_popularity_run_dated_in_the_future_is_refused_before_any_write(catalog_db):
    today = catalog_db.today()
    card = catalog_db.card(views=50, score=12)
    for age in (2, 1):
        catalog_db.seed_snapshot(card, today - timedelta(days=age), 10 * age)
    state = lambda: catalog_db.q(  # noqa: E731
        "SELECT id, popularity_score, updated_at FROM catalog.property_object_cards"
    )
    before = state()
    r = run_dag(CATALOG, {}, logical_date=night(today + timedelta(days=40)))
    assert r["state"] == "failed"
    assert r["tasks"]["validate_options"] == "failed"
    assert r["tasks"]["acquire_lease"] == "upstream_failed"
    assert state() == before
    assert catalog_db.snapshots(card) == [
        (today - timedelta(days=2), 20),
        (today - timedelta(days=1), 10),
    ]
    assert catalog_db.score(card) == 12
    assert catalog_db.one("SELECT to_regnamespace('pin_nightly') IS NULL")  # no step ran
    # today is allowed
    assert assert_ok(run_dag(CATALOG, {}))["status"] == "success"


def test_future_dated_snapshots_are_reported_and_never_set_the_retention_horizon(catalog_db):
    """Rows dated in the future (written before dates were bounded, or by hand) stop the job
    with a status that says what to delete, and retention keeps the real history."""
    today = catalog_db.today()
    card = catalog_db.card(views=50)
    real = [(today - timedelta(days=age), 40 - age) for age in (3, 2, 1)]
    for d, v in real:
        catalog_db.seed_snapshot(card, d, v)
    catalog_db.seed_snapshot(card, today + timedelta(days=40), 45)
    s = assert_ok(run_dag(CATALOG, {}))
    assert s["status"].startswith("nothing written: snapshots dated after today"), s
    assert "delete them" in s["status"]
    assert catalog_db.snapshots(card) == [*real, (today + timedelta(days=40), 45)]
    # the runbook's recovery: delete the future rows; the next run works
    catalog_db.q("DELETE FROM catalog.popularity_daily_views WHERE run_date > %s", today)
    assert assert_ok(run_dag(CATALOG, {}))["status"] == "success"
    assert catalog_db.snapshots(card) == [*real, (today, 50)]


# --- a late clear of an older run -------------------------------------------------------------


@pytest.mark.long
def test_a_late_clear_of_an_older_popularity_run_writes_nothing(catalog_db):
    """Night D's property-object range fails; nights D+1 and D+2 run; then the on-call clears
    the failed task instance of night D (with its downstream tasks, as the runbook says). The
    range finds its sweep abandoned for a newer date: it writes nothing (no snapshot stamped
    with today's counter under D, no score as of D) and ends green, saying which run took over;
    the summary says nothing was written."""
    db = catalog_db
    d = db.today() - timedelta(days=2)
    cards = db.cards_seen_the_night_before(d, 9, views=100, seen=50)
    db.fail_updates_of(cards[7], "catalog.property_object_cards")
    conf = {"batch_size": 2, "max_ranges": 2}
    night_d = run_night(CATALOG, conf, d)
    assert night_d["state"] == "failed"
    db.allow_updates("catalog.property_object_cards")
    for k in (1, 2):
        db.q("UPDATE catalog.property_object_cards SET popularity_views = popularity_views + 7")
        assert assert_ok(run_night(CATALOG, conf, d + timedelta(days=k)))["status"] == "success"
    db.q("UPDATE catalog.property_object_cards SET popularity_views = popularity_views + 1000")
    before = db.q(
        "SELECT card_id, run_date, cumulative_views FROM catalog.popularity_daily_views "
        "ORDER BY 1, 2"
    )
    scores = {c: db.score(c) for c in cards}
    assert all(s > 0 for s in scores.values())
    r = clear_and_resume(
        CATALOG, night_d["run_id"], task_ids=failed_tasks(night_d), only_failed=False
    )
    assert r["state"] == "success", r["tasks"]
    after = db.q(
        "SELECT card_id, run_date, cumulative_views FROM catalog.popularity_daily_views "
        "ORDER BY 1, 2"
    )
    assert after == before
    assert {c: db.score(c) for c in cards} == scores
    newest = d + timedelta(days=2)
    for c in cards:
        assert db.score(c) == reference_popularity_score(dict(db.snapshots(c)), newest, W, H)
    assert r["summary"]["status"].startswith("nothing written: superseded by the run "), r
    assert r["summary"]["status"].endswith(f" of {newest.isoformat()}")
    assert db.q("SELECT count(*) FROM pin_nightly.job_lease") == [(0,)]


def test_a_late_clear_of_an_older_news_range_leaves_the_adopted_range_alone(news_db):
    """Night D's FullSweep range fails; night D+1 adopts the unfinished sweep and runs out of
    its budget before the range; then the on-call clears night D's failed range. It belongs to
    D+1's acquisition now: the cleared task writes nothing and ends green, and the range keeps
    its cursor for the next night, which finishes it."""
    db = news_db
    ids = db.posts(30, drift_every=1)
    db.fail_updates_of(ids[25])
    conf = {"scope": "FullSweep", "batch_size": 5, "max_ranges": 2}
    d = db.today() - timedelta(days=3)
    night_d = run_dag(NEWS, conf, logical_date=night(d))
    assert night_d["state"] == "failed" and night_d["tasks"]["reconcile_range[1]"] == "failed"
    db.allow_updates()
    cursor = db.q("SELECT owner, cursor_id FROM pin_nightly.sweep_range WHERE range_no = 1")
    starved = {"scope": "DailyWindow", "max_run_duration_minutes": 0.0001}
    s1 = assert_ok(run_dag(NEWS, starved, logical_date=night(d + timedelta(days=1))))
    assert s1["status"] == "backlog_remaining"
    ((owner_d1, cursor_d1),) = db.q(
        "SELECT owner, cursor_id FROM pin_nightly.sweep_range WHERE range_no = 1"
    )
    assert owner_d1 != cursor[0][0] and cursor_d1 == cursor[0][1]
    corrections = db.one("SELECT count(*) FROM pin_nightly.news_drift")
    r = clear_and_resume(NEWS, night_d["run_id"], task_ids=failed_tasks(night_d), only_failed=False)
    assert r["state"] == "success", r["tasks"]
    assert db.one("SELECT count(*) FROM pin_nightly.news_drift") == corrections
    assert db.q("SELECT owner, cursor_id FROM pin_nightly.sweep_range WHERE range_no = 1") == [
        (owner_d1, cursor_d1)
    ]
    assert db.drifted_posts() == 30 - corrections
    assert db.q("SELECT count(*) FROM pin_nightly.job_lease") == [(0,)]
    s3 = assert_ok(run_dag(NEWS, {"scope": "DailyWindow"}, logical_date=night(d + timedelta(2))))
    assert s3["status"] == "success" and db.drifted_posts() == 0
    assert db.q("SELECT count(*), count(DISTINCT post_id) FROM pin_nightly.news_drift") == [
        (30, 30)
    ]


# --- adoption adds, never replaces; a pass's identity includes its formula --------------------


def test_a_daily_window_after_an_unfinished_one_covers_its_own_window_too(news_db):
    """Night D's DailyWindow runs out of its budget; comments change after it; night D+1's
    DailyWindow corrects both what D left and what changed since (its window reaches back to
    the last completed sweep), ends success, and D's window is closed as abandoned."""
    db = news_db
    now = datetime.now(UTC)
    old = db.post(count=5, visible=3, comments_at=now - timedelta(hours=2))
    d = db.today() - timedelta(days=1)
    starved = {"scope": "DailyWindow", "max_run_duration_minutes": 0.0001}
    r1 = run_dag(NEWS, starved, logical_date=night(d))
    s1 = assert_ok(r1)
    assert s1["status"] == "backlog_remaining" and db.count(old) == 5
    # the grid's note says which green this is, and what is left
    [(sweep,)] = db.q("SELECT sweep_id FROM pin_nightly.sweep")
    assert r1["note"] == (
        f"backlog_remaining: DailyWindow, {s1['posts_reconciled']} posts checked, 0 corrected, "
        f"0 failed; left for the next run: DailyWindow (sweep {sweep})"
    ), r1["note"]
    new = db.post(count=9, visible=1, comments_at=datetime.now(UTC))
    s2 = assert_ok(run_dag(NEWS, {"scope": "DailyWindow"}, logical_date=night(d) + timedelta(1)))
    assert s2["status"] == "success", s2
    assert (db.count(old), db.count(new)) == (3, 1)
    assert db.q("SELECT status FROM pin_nightly.sweep ORDER BY sweep_id") == [
        ("abandoned",),
        ("done",),
    ]


def test_a_whole_run_clear_sends_only_what_the_run_had_not_counted(news_db):
    """A FullSweep runs out of its budget after its first batch (backlog_remaining, green);
    the whole run is cleared (the same run id, from the start) and finishes. Its result counts
    all the run's work, and the counters its two summaries sent add up to it: every post once."""
    db = news_db
    db.posts(20, drift_every=1)
    conf = {"scope": "FullSweep", "batch_size": 5, "max_ranges": 1}
    logical = night(db.today() - timedelta(days=1))
    with budget_spent_after_each_batch(db):
        first = run_dag(NEWS, conf, logical_date=logical)
    s1 = assert_ok(first)
    assert s1["status"] == "backlog_remaining" and 0 < s1["posts_reconciled"] < 20, s1
    again = run_dag(NEWS, conf, logical_date=logical, run_id=first["run_id"])
    assert again["run_id"] == first["run_id"]
    s2 = assert_ok(again)
    assert s2["status"] == "success" and s2["posts_reconciled"] == 20, s2
    assert db.drifted_posts() == 0
    sent = {"news_comment_reconcile_posts_reconciled_total": 0}
    for (signals,) in db.q("SELECT signals FROM pin_nightly.run_signal ORDER BY emitted_at"):
        for name, value, _ in signals["run_totals"]:
            sent[name] = sent.get(name, 0) + value
    assert sent["news_comment_reconcile_posts_reconciled_total"] == 20, sent


def test_a_run_with_another_formula_never_adopts_the_nightly_pass_of_its_date(catalog_db):
    """The nightly pass of D fails half-way; a manual run of the same date with another window
    does not continue it (that would score half the cards with one formula and half with
    another), nor abandon it: it recomputes every card with its own window."""
    db = catalog_db
    d = db.today() - timedelta(days=1)
    cards = [db.card(views=100 + 10 * i) for i in range(8)]
    for c in cards:
        for age, v in ((25, 10), (15, 30), (5, 60)):  # the two windows read different days
            db.seed_snapshot(c, d - timedelta(days=age), v)
    db.fail_updates_of(cards[5], "catalog.property_object_cards")
    nightly = run_night(CATALOG, {"batch_size": 2, "max_ranges": 1}, d)
    assert nightly["state"] == "failed"
    db.allow_updates("catalog.property_object_cards")
    half = [db.score(c) for c in cards[:4]]
    assert all(s > 0 for s in half)
    manual = {"batch_size": 2, "max_ranges": 1, "window_days": 10}
    r = run_night(CATALOG, manual, d)
    s = assert_ok(r)
    assert s["status"] == "backlog_remaining", s  # the nightly's pass is still to finish
    # not the date's scoring: no scored date, no fresh-scores event, no last-success time
    assert s["scores_as_of_date"] is None and r["tasks"]["publish"] == "skipped", r
    [(signals,)] = db.q("SELECT signals FROM pin_nightly.run_signal WHERE run_id = %s", r["run_id"])
    assert not [g for g in signals["gauges"] if g[0].endswith("_last_success_timestamp_seconds")]
    for c in cards:
        assert db.score(c) == reference_popularity_score(dict(db.snapshots(c)), d, 10, H), c
    scopes = db.q("SELECT scope, status FROM pin_nightly.sweep ORDER BY sweep_id")
    assert scopes[0] == (f"PropertyObject@{d}", "open")  # the nightly's, left to the nightly
    assert (f"PropertyObject@{d} window 10d half-life 7d", "done") in scopes


# --- one bad row never turns every night red ---------------------------------------------------


@pytest.mark.long
def test_a_post_that_cannot_be_written_is_isolated_and_every_night_stays_green(news_db):
    """A domain trigger rejects the update of one drifted post. The batch writes the others,
    the post is recorded with its error in pin_nightly.item_error and counted in item_errors,
    and the run ends green. The next nights hold it back while its row is unchanged (counted,
    tried once with the other held rows, not recorded again); a change of its row, or
    retry_failed_rows, has it tried and recorded again; once the rule is gone it is written."""
    db = news_db
    ids = db.posts(12, drift_every=1)
    bad = ids[4]
    db.fail_updates_of(bad, errcode="raise_exception")
    conf = {"scope": "FullSweep", "batch_size": 5, "max_ranges": 1}
    d = db.today() - timedelta(days=5)

    def night_run(k: int, **extra) -> dict:
        s = assert_ok(run_dag(NEWS, {**conf, **extra}, logical_date=night(d + timedelta(days=k))))
        assert s["status"] == "success", s
        return s

    def records() -> int:
        return db.one("SELECT count(*) FROM pin_nightly.item_error WHERE item_id = %s", bad)

    s = night_run(0)
    assert s["item_errors"] == 1 and s["drift_corrected"] == 11, s
    assert db.q("SELECT item_id::text, sqlstate, message FROM pin_nightly.item_error") == [
        (bad, "P0001", "rejected (simulated)")
    ]
    s = night_run(1)  # held back: counted, not recorded again
    assert (s["item_errors"], s["drift_corrected"], records()) == (1, 0, 1), s
    assert db.drifted_posts() == 1 and db.count(bad) == 5
    db.q("ALTER TABLE news.posts DISABLE TRIGGER fail_one")  # the platform changes the row
    db.q("UPDATE news.posts SET updated_at = now() WHERE id = %s", bad)
    db.q("ALTER TABLE news.posts ENABLE TRIGGER fail_one")
    s = night_run(2)  # its row changed: tried and recorded again
    assert (s["item_errors"], records()) == (1, 2), s
    s = night_run(3, retry_failed_rows=True)  # unchanged, but asked for
    assert (s["item_errors"], records()) == (1, 3), s
    db.allow_updates()
    s = night_run(4)  # held back, tried with the others held: the rule is gone, written
    assert (s["item_errors"], s["drift_corrected"], records()) == (0, 1, 3), s
    assert db.drifted_posts() == 0


def test_a_card_that_cannot_be_written_is_isolated_and_the_run_stays_green(
    catalog_db, capfd, caplog
):
    """The card is recorded and logged with its kind and id (the spec's CardKind, CardId)."""
    db = catalog_db
    d = db.today() - timedelta(days=1)
    cards = db.cards_seen_the_night_before(d, 6)
    db.fail_updates_of(cards[3], "catalog.property_object_cards", errcode="check_violation")
    capfd.readouterr()
    s = assert_ok(run_night(CATALOG, {"batch_size": 4}, d))
    out = capfd.readouterr()
    assert s["status"] == "success" and s["item_errors"] == 1, s
    assert db.q("SELECT item_kind, item_id::text, sqlstate FROM pin_nightly.item_error") == [
        ("PropertyObject", cards[3], "23514")
    ]
    failed = f"item failed: card_kind=PropertyObject card_id={cards[3]} sqlstate=23514"
    assert failed in out.out + out.err + caplog.text
    for c in cards:
        snaps = dict(db.snapshots(c))
        if c == cards[3]:  # nothing of it written: no snapshot of d, its score untouched
            assert d not in snaps and db.score(c) == 0
        else:
            assert db.score(c) == reference_popularity_score(snaps, d, W, H) > 0


def test_a_rule_that_rejects_every_card_fails_the_run_and_publishes_nothing(catalog_db):
    """A CHECK-like trigger rejects every score update: each card is isolated and recorded, but
    a run in which most rows failed is not a success: its summary fails after the run is logged,
    no asset event, and the last-success time stays where it was."""
    db = catalog_db
    d = db.today() - timedelta(days=2)
    cards = db.cards_seen_the_night_before(d, 12)
    db.reject_all_updates("catalog.property_object_cards")
    r = run_night(CATALOG, {"batch_size": 5}, d)
    assert r["state"] == "failed" and r["tasks"]["summarize"] == "failed", r
    assert r["tasks"]["publish"] == "upstream_failed"
    [(status, result)] = db.q("SELECT status, result FROM pin_nightly.run_log")
    assert status == "failed: 12 of 12 rows could not be written", status
    assert result["item_errors"] == 12
    assert db.one("SELECT count(*) FROM pin_nightly.item_error") == 12
    [(signals,)] = db.q("SELECT signals FROM pin_nightly.run_signal")
    assert not [g for g in signals["gauges"] if g[0].endswith("_last_success_timestamp_seconds")]
    assert all(db.score(c) == 0 for c in cards)
    # the date does not count as scored: the staleness gauges stay where they were
    assert result["scores_as_of_date"] is None, result
    # the rule is lifted: the next night scores every card, and the date counts again
    db.allow_updates("catalog.property_object_cards")
    r = run_night(CATALOG, {"batch_size": 5}, d + timedelta(days=1))
    assert r["state"] == "success", r
    d1 = d + timedelta(days=1)
    assert r["note"] == (
        f"success: {d1}, 12 property-object and 0 project cards updated, 0 failed, "
        f"scores as of {d1}"
    ), r["note"]
    _a_persons_note_is_kept(CATALOG, r["run_id"])
    result = db.one("SELECT result FROM pin_nightly.run_log WHERE status = 'success'")
    assert result["scores_as_of_date"] == (d + timedelta(days=1)).isoformat(), result
    assert all(db.score(c) > 0 for c in cards)


def test_a_full_sweep_whose_posts_all_fail_is_not_the_job_s_work_done(news_db):
    """Every post update is rejected: the FullSweep's summary fails and the sweep does not count
    as completed (the last-FullSweep gauge stays); once the rule is lifted, the next FullSweep
    corrects every post and counts."""
    db = news_db
    ids = db.posts(12, drift_every=1)
    db.reject_all_updates("news.posts")
    conf = {"scope": "FullSweep", "batch_size": 5}
    d = db.today() - timedelta(days=2)
    r = run_dag(NEWS, conf, logical_date=night(d))
    assert r["tasks"]["summarize"] == "failed", r
    assert r["note"] == (
        "failed before its summary (failed tasks: publish, summarize): see the runbook"
    ), r["note"]
    assert db.one("SELECT status FROM pin_nightly.run_log").startswith("failed: 12 of 12 rows")
    completed = sql("common/sweeps_last_completed")
    job = {"job": "news-comment-reconcile"}
    assert db.conn.execute(completed, job).fetchall() == []
    db.allow_updates()
    assert_ok(run_dag(NEWS, conf, logical_date=night(d + timedelta(days=1))))
    assert [f for f, _ in db.conn.execute(completed, job).fetchall()] == ["FullSweep"]
    assert db.drifted_posts() == 0 and len(ids) == 12


def _a_persons_note_is_kept(dag_id: str, run_id: str) -> None:
    """A note a person wrote on the run stays when the run ends again (a clear)."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session

    from pin_nightly import notes

    with create_session() as session:
        dr = session.query(DagRun).filter_by(dag_id=dag_id, run_id=run_id).one()
        dr.dag_run_note.content, dr.dag_run_note.user_id = "investigating: Anna", "anna"
        notes.on_dag_run_success(dag_run=dr, msg="success")
    with create_session() as session:
        dr = session.query(DagRun).filter_by(dag_id=dag_id, run_id=run_id).one()
        assert dr.note == "investigating: Anna"


# --- job-owned tables stay bounded ------------------------------------------------------------


def _age(db, table: str, column: str, days: int, where: str = "TRUE") -> None:
    db.q(
        f"UPDATE pin_nightly.{table} SET {column} = now() - %s * interval '1 day' WHERE {where}",
        days,
    )


def _nightly(d) -> dict:
    """run_dag arguments of the scheduled run of night ``d``."""
    return {"logical_date": night(d), "run_id": f"scheduled__{night(d).isoformat()}"}


def test_job_owned_history_is_pruned_past_its_retention_by_the_nightly_runs(news_db):
    """Two nights' sweeps, drift records, run-log rows and a recorded item error, aged 100 and
    10 days: the next nightly run deletes what is older than its retention params (90 days)
    and keeps the newest completed sweep of each family whatever its age."""
    db = news_db
    conf = {"scope": "FullSweep", "batch_size": 50}
    d = db.today() - timedelta(days=3)
    db.posts(4, drift_every=1)
    old = assert_ok(run_dag(NEWS, conf, **_nightly(d)))
    fresh = lambda n: [  # noqa: E731 - drifted posts with comment activity just now
        db.post(count=3, visible=1, comments_at=datetime.now(UTC)) for _ in range(n)
    ]
    fresh(4)
    window = {"scope": "DailyWindow"}
    recent = assert_ok(run_dag(NEWS, window, **_nightly(d + timedelta(1))))
    db.q(
        "INSERT INTO pin_nightly.item_error (job, run_id, sweep_id, item_id, message, "
        "recorded_at) VALUES ('news-comment-reconcile', 'x', 1, gen_random_uuid(), 'old', "
        "now() - interval '100 days')"
    )
    for table, column in (("sweep", "completed_at"), ("run_log", "finished_at")):
        _age(db, table, column, 100, f"run_id = '{old['run_id']}'")
        _age(db, table, column, 10, f"run_id = '{recent['run_id']}'")
    _age(db, "news_drift", "recorded_at", 100, f"run_id = '{old['run_id']}'")
    _age(db, "news_drift", "recorded_at", 10, f"run_id = '{recent['run_id']}'")
    fresh(2)
    s = assert_ok(run_dag(NEWS, window, **_nightly(d + timedelta(2))))
    assert s["history_pruned"] == {
        "run_log_retention_days": 1,
        "sweep_retention_days": 0,  # the old FullSweep is its family's newest completed one
        "item_error_retention_days": 1,
        "drift_retention_days": 4,
    }
    assert db.q("SELECT run_id FROM pin_nightly.run_log ORDER BY finished_at") == [
        (recent["run_id"],),
        (s["run_id"],),
    ]
    assert db.q("SELECT scope FROM pin_nightly.sweep ORDER BY sweep_id") == [
        ("FullSweep",),
        ("DailyWindow",),
        ("DailyWindow",),
    ]
    assert db.q("SELECT count(*) FROM pin_nightly.news_drift") == [(6,)]
    assert db.q("SELECT count(*) FROM pin_nightly.item_error") == [(0,)]
    # a newer FullSweep completes: the old one is no longer needed and goes
    db.q(
        "UPDATE pin_nightly.sweep SET completed_at = now() - interval '100 days' "
        "WHERE scope = 'DailyWindow' AND run_id = %s",
        recent["run_id"],
    )
    s = assert_ok(run_dag(NEWS, conf, **_nightly(d + timedelta(3))))
    assert s["history_pruned"]["sweep_retention_days"] == 2
    assert db.q("SELECT scope, status FROM pin_nightly.sweep ORDER BY sweep_id") == [
        ("DailyWindow", "done"),
        ("FullSweep", "done"),
    ]
    assert (
        db.one(
            "SELECT count(*) FROM pin_nightly.sweep_range WHERE sweep_id NOT IN "
            "(SELECT sweep_id FROM pin_nightly.sweep)"
        )
        == 0
    )


@pytest.mark.long
def test_history_the_signals_or_the_rotation_need_is_kept_and_manual_runs_prune_nothing(
    news_db, scheduler_dag
):
    """Past every retention: a manual run (a repair, a run with other params) deletes nothing;
    a nightly run keeps the drift records no nightly summary has counted yet, and the newest
    sweep of each family even when it was abandoned (the next sweep starts with what it left
    unreached); a retention param below the runbook's 90 days creates no run."""
    from airflow.sdk.definitions.param import ParamValidationError

    db = news_db
    full = {"scope": "FullSweep", "batch_size": 50}
    d = db.today() - timedelta(days=4)
    db.posts(4, drift_every=1)
    first = assert_ok(run_dag(NEWS, full, **_nightly(d)))
    db.posts(3, drift_every=1)
    second = assert_ok(run_dag(NEWS, full, **_nightly(d + timedelta(1))))
    assert first["drift_corrected"] == 4 and second["drift_corrected"] == 3
    for table, column in (("sweep", "completed_at"), ("run_log", "finished_at")):
        _age(db, table, column, 100)
    _age(db, "news_drift", "recorded_at", 100)
    db.q("UPDATE pin_nightly.sweep SET status = 'abandoned' WHERE run_id = %s", second["run_id"])
    # as if the newest nightly summary had counted through 150 days ago: nothing since is counted
    _age(db, "run_signal", "drift_through", 150)
    for params in ({"drift_retention_days": 1}, {"sweep_retention_days": 89}):
        with pytest.raises(ParamValidationError):
            scheduler_dag(NEWS).params.deep_merge(params).validate()
    manual = assert_ok(run_dag(NEWS, {"scope": "DailyWindow"}, logical_date=night(d)))
    assert manual["history_pruned"] == {}
    assert db.one("SELECT count(*) FROM pin_nightly.run_log") == 3
    nightly = assert_ok(run_dag(NEWS, {"scope": "DailyWindow"}, **_nightly(d + timedelta(2))))
    assert nightly["history_pruned"]["drift_retention_days"] == 0  # not counted yet
    assert nightly["history_pruned"]["run_log_retention_days"] == 2
    assert db.one("SELECT count(*) FROM pin_nightly.news_drift") == 7
    kept = db.q("SELECT run_id, status FROM pin_nightly.sweep WHERE scope = 'FullSweep'")
    assert sorted(kept) == sorted([(first["run_id"], "done"), (second["run_id"], "abandoned")])
    # its summary counted through now: the next nightly run deletes what it counted
    nightly = assert_ok(run_dag(NEWS, {"scope": "DailyWindow"}, **_nightly(d + timedelta(3))))
    assert nightly["history_pruned"]["drift_retention_days"] == 7
    assert db.one("SELECT count(*) FROM pin_nightly.news_drift") == 0


# --- no starvation when the budget keeps cutting a pass ----------------------------------------


@pytest.mark.long
def test_a_catalog_that_outgrows_its_budget_reaches_every_card_of_both_kinds(catalog_db):
    """Every batch of 2 cards takes 0.5 s (a trigger sleeps) and a night's budget is 12 s: the
    40 property-object cards would take 10 s, the 20 project cards 5 s after them. Each night the
    property-object pass uses at most its share of the budget (40 / 60), so the project pass
    always gets its own, and each pass starts where the previous night's stopped and wraps
    around. Within three nights every card of both kinds has a snapshot and its score."""
    db = catalog_db
    run_sql_file(db.dsn, "schema/catalog_popularity.sql")
    cards = {db.card(views=5 + i): "PropertyObject" for i in range(40)}
    cards |= {db.card(views=7 + i, kind="Project"): "Project" for i in range(20)}
    db.q(
        "CREATE FUNCTION public.pin_test_slow() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN PERFORM pg_sleep(0.5); RETURN NULL; END $$"
    )
    db.q(
        "CREATE TRIGGER pin_test_slow BEFORE INSERT ON catalog.popularity_daily_views "
        "FOR EACH STATEMENT EXECUTE FUNCTION public.pin_test_slow()"
    )
    conf = {"batch_size": 2, "max_ranges": 1, "max_run_duration_minutes": 0.2}
    d0 = db.today() - timedelta(days=5)
    reached: list[set] = []
    for k in range(3):
        s = assert_ok(run_night(CATALOG, conf, d0 + timedelta(days=k)))
        assert s["status"] in ("backlog_remaining", "success"), s
        assert s["property_object_cards_processed"] > 0 and s["project_cards_processed"] > 0, s
        reached.append({c for c in cards if db.snapshots(c)})
    assert reached[-1] == set(cards), (len(reached[0]), len(reached[1]), len(reached[2]))
    assert len(reached[0]) < len(cards)  # the budget did cut the first night
    for c, kind in cards.items():
        snaps = dict(db.snapshots(c))
        assert db.score(c, kind) == reference_popularity_score(snaps, max(snaps), W, H)
