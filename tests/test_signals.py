"""Signals that ordinary operations can neither silence nor fake: what each summary sends is
stored in ``pin_nightly.run_signal`` (once per acquisition) and asserted here from the database;
tests/test_metrics.py proves the same values reach StatsD."""

from __future__ import annotations

from datetime import date, timedelta

import pytest

from tests.helpers import assert_ok, inject, night
from tools.rundag import clear_and_resume, run_dag

NEWS = "news_comment_reconcile"
# Nights before today: the manual runs of a test are triggered now, after them. A nightly run's
# scope is given, so no date decides anything else here.
D = date.today() - timedelta(days=5)
LATER = 10  # days after D: a night after the manual runs
NIGHTLY = {"scope": "FullSweep", "batch_size": 2, "max_ranges": 1, "drift_alert_threshold": 4}


def nightly(d: date, conf: dict | None = None) -> dict:
    """The scheduled run of night ``d``."""
    slot = night(d)
    return run_dag(
        NEWS, conf or NIGHTLY, logical_date=slot, run_id=f"scheduled__{slot.isoformat()}"
    )


def signals(db, run_id: str) -> dict:
    [(sent,)] = db.q("SELECT signals FROM pin_nightly.run_signal WHERE run_id = %s", run_id)
    return {
        **{f"gauge {n}": v for n, v, _ in sent["gauges"]},
        **{f"counter {n}": v for n, v, _ in sent["counters"] + sent["run_totals"]},
        "alert": sent["alert"],
    }


DRIFT = "gauge news_comment_reconcile_last_run_drift_corrected"
THRESHOLD = "gauge news_comment_reconcile_drift_alert_threshold"
CORRECTED = "counter news_comment_reconcile_drift_corrected_total"


def test_drift_counts_what_was_durably_corrected_and_only_nightly_runs_set_its_gauges(
    news_db, monkeypatch
):
    db = news_db
    assert_ok(nightly(D))  # a first night: the watermark the next nightly summary counts from

    # a spike split across a run that dies mid-sweep and the run that adopts its sweep: each
    # corrects no more than the threshold, together they do
    db.posts(6, drift_every=1)
    inject(monkeypatch, "pin_nightly.news.make_batch", "mid_batch")
    failed = nightly(D + timedelta(1))
    assert failed["state"] == "failed" and failed["tasks"]["summarize"] == "failed"
    assert db.drifted_posts() == 4  # its first batch committed
    monkeypatch.undo()
    adopter = nightly(D + timedelta(2))
    s = assert_ok(adopter)
    assert s["drift_corrected"] == 4 and db.drifted_posts() == 0
    sent = signals(db, adopter["run_id"])
    assert (sent[DRIFT], sent[THRESHOLD], sent[CORRECTED]) == (6, 4, 6)
    assert sent["alert"]["drift_corrected"] == 6
    assert sent["alert"]["counted"] == "since the previous nightly run's summary"

    # manual runs set none of the gauges the rules compare: a targeted repair of one post, a
    # run with a huge threshold
    [target] = db.posts(1, drift_every=1)
    repair = run_dag(NEWS, {"post_ids": [target], "drift_alert_threshold": 0})
    assert_ok(repair)
    sent = signals(db, repair["run_id"])
    assert DRIFT not in sent and THRESHOLD not in sent
    assert (sent[CORRECTED], sent["alert"]["counted"]) == (1, "in this run")
    db.posts(2, drift_every=1)
    muted = run_dag(NEWS, {**NIGHTLY, "drift_alert_threshold": 10**9})
    sent = signals(db, muted["run_id"])
    assert THRESHOLD not in sent and DRIFT not in sent and sent["alert"] is None

    # the next nightly counts the manual FullSweep's corrections and its own, not the repair's
    db.posts(1, drift_every=1)
    third = nightly(D + timedelta(LATER))
    sent = signals(db, third["run_id"])
    assert (sent[DRIFT], sent[THRESHOLD], sent[CORRECTED], sent["alert"]) == (3, 4, 1, None)
    # every correction counted exactly once, across all summaries
    total = db.one("SELECT count(*) FROM pin_nightly.news_drift WHERE NOT dry_run")
    counted = db.one(
        "SELECT sum((c->>1)::int) FROM pin_nightly.run_signal, jsonb_array_elements(signals->"
        "'counters') c WHERE c->>0 = 'news_comment_reconcile_drift_corrected_total'"
    )
    assert total == counted == 6 + 1 + 2 + 1


def test_a_summary_run_again_sends_nothing_new(news_db):
    """Clearing the summary of a run that did its work: the same signals, stored once, and the
    last success is when the work completed, not when the summary ran again."""
    db = news_db
    db.posts(3, drift_every=1)
    first = nightly(D)
    assert_ok(first)
    [(emitted, done)] = db.q(
        "SELECT emitted_at, work_done_at FROM pin_nightly.run_signal WHERE run_id = %s",
        first["run_id"],
    )
    last_write = db.one(
        "SELECT max(updated_at) FROM pin_nightly.sweep_range r JOIN pin_nightly.run_signal g "
        "ON g.owner = r.owner WHERE g.run_id = %s",
        first["run_id"],
    )
    assert done == last_write < emitted
    again = clear_and_resume(NEWS, first["run_id"], ["summarize"], only_failed=False)
    assert again["state"] == "success" and again["summary"]["status"] == "success"
    assert db.q(
        "SELECT emitted_at, work_done_at FROM pin_nightly.run_signal WHERE run_id = %s",
        first["run_id"],
    ) == [(emitted, done)]
    sent = signals(db, first["run_id"])
    assert sent["gauge news_comment_reconcile_last_success_timestamp_seconds"] == pytest.approx(
        done.timestamp()
    )


def test_a_summary_cleared_after_a_newer_run_counts_nothing_of_it(news_db, monkeypatch):
    """An old run whose summary failed, cleared after a newer night: it counts no window (the
    newer run's corrections stay counted by it) and sets no nightly gauge."""
    db = news_db
    assert_ok(nightly(D))
    db.posts(2, drift_every=1)
    inject(monkeypatch, "pin_nightly.runs.summarize", "before")
    old = nightly(D + timedelta(1))
    assert old["tasks"]["summarize"] == "failed"
    monkeypatch.undo()
    db.posts(3, drift_every=1)
    newer = nightly(D + timedelta(2))
    assert signals(db, newer["run_id"])[CORRECTED] == 5
    late = clear_and_resume(NEWS, old["run_id"], ["summarize"])
    assert late["tasks"]["summarize"] == "success"
    sent = signals(db, old["run_id"])
    assert sent[CORRECTED] == 0 and DRIFT not in sent and sent["alert"] is None


# Corrections by sign: up, the stored count was too low; down, it was too high.
BY_DIRECTION = {
    "counter": "news_comment_reconcile_drift_total",
    "gauge": "news_comment_reconcile_last_run_drift",
}
UP_DOWN = (
    "SELECT count(*) FILTER (WHERE count_to > count_from), "
    "count(*) FILTER (WHERE count_to < count_from) FROM pin_nightly.news_drift WHERE NOT dry_run"
)


def by_direction(db, run_id: str) -> dict:
    """The per-direction counters and gauges a run's summary stored: ``{"counter up": n, ...}``;
    a gauge the run did not set is absent."""
    [(sent,)] = db.q("SELECT signals FROM pin_nightly.run_signal WHERE run_id = %s", run_id)
    out = {}
    for kind, sent_as in (("counter", ("counters", "run_totals")), ("gauge", ("gauges",))):
        for name, value, tags in (m for key in sent_as for m in sent[key]):
            if name == BY_DIRECTION[kind]:
                out[f"{kind} {tags['direction']}"] = value
    return out


def drifted(db, ups: int, downs: int) -> None:
    """Posts whose stored count is too low (up) and too high (down), created alternately (up
    first) so that every batch of two holds one of each while both last."""
    for i in range(max(ups, downs)):
        if i < ups:
            db.post(count=0, visible=2)
        if i < downs:
            db.post(count=5, visible=2)


def counted_by_direction(db) -> tuple[int, int]:
    """What every summary so far counted, up and down."""
    rows = db.q(
        "SELECT c->2->>'direction', sum((c->>1)::int) FROM pin_nightly.run_signal, "
        "jsonb_array_elements(signals->'counters') c "
        "WHERE c->>0 = 'news_comment_reconcile_drift_total' GROUP BY 1"
    )
    sums = dict(rows)
    return sums.get("up", 0), sums.get("down", 0)


def test_a_night_counts_its_corrections_by_direction(news_db):
    db = news_db
    assert_ok(nightly(D))
    drifted(db, ups=3, downs=2)
    db.posts(2)  # in step: nothing to correct
    night_run = nightly(D + timedelta(1))
    assert assert_ok(night_run)["drift_corrected"] == 5
    sent = by_direction(db, night_run["run_id"])
    assert sent == {"counter up": 3, "counter down": 2, "gauge up": 3, "gauge down": 2}
    assert signals(db, night_run["run_id"])[DRIFT] == 5  # the night's total: their sum

    # a targeted repair counts its correction by direction and sets no gauge
    [target] = db.posts(1, drift_every=1)
    repair = run_dag(NEWS, {"post_ids": [target]})
    assert_ok(repair)
    assert by_direction(db, repair["run_id"]) == {"counter up": 0, "counter down": 1}

    # the next night: one lost increment of its own, the repair's correction aside
    drifted(db, ups=1, downs=0)
    later = nightly(D + timedelta(LATER))
    sent = by_direction(db, later["run_id"])
    assert sent == {"counter up": 1, "counter down": 0, "gauge up": 1, "gauge down": 0}
    assert counted_by_direction(db) == tuple(db.q(UP_DOWN)[0]) == (4, 3)


def test_a_run_that_dies_mid_sweep_and_the_next_count_each_direction_once(news_db, monkeypatch):
    db = news_db
    assert_ok(nightly(D))
    drifted(db, ups=4, downs=2)
    inject(monkeypatch, "pin_nightly.news.make_batch", "mid_batch")
    failed = nightly(D + timedelta(1))
    assert failed["state"] == "failed" and failed["tasks"]["summarize"] == "failed"
    # its first batch committed one correction of each sign, which its summary never counted
    assert db.q(UP_DOWN + " AND run_id = %s", failed["run_id"]) == [(1, 1)]
    assert not db.q("SELECT 1 FROM pin_nightly.run_signal WHERE run_id = %s", failed["run_id"])
    monkeypatch.undo()
    adopter = nightly(D + timedelta(2))
    assert assert_ok(adopter)["drift_corrected"] == 4 and db.drifted_posts() == 0
    sent = by_direction(db, adopter["run_id"])
    assert sent == {"counter up": 4, "counter down": 2, "gauge up": 4, "gauge down": 2}

    # a night after: nothing new in either direction, and nothing counted twice
    quiet = nightly(D + timedelta(3))
    sent = by_direction(db, quiet["run_id"])
    assert sent == {"counter up": 0, "counter down": 0, "gauge up": 0, "gauge down": 0}
    assert counted_by_direction(db) == tuple(db.q(UP_DOWN)[0]) == (4, 2)
