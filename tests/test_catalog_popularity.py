"""catalog_popularity_recompute end to end: real Airflow (dag.test) on a real PostgreSQL."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
import uuid
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import psycopg
import pytest

from tests.helpers import SlowVacuum, assert_ok, night, run_night, set_clock, when
from tests.helpers import reference_popularity_score as reference_score
from tools import pgbench

DAG = "catalog_popularity_recompute"
D = date(2026, 8, 31)  # a Monday, far enough back that every night a test runs is past


def run(conf=None, as_of: date = D, **kw):
    return run_night(DAG, conf, as_of, **kw)


def test_empty_catalog_is_a_noop_success(catalog_db):
    s = assert_ok(run())
    assert s["snapshots_written"] == 0 and s["item_errors"] == 0
    assert s["property_object_cards_updated"] == s["project_cards_updated"] == 0
    assert s["as_of_date"] == D.isoformat()


def test_zero_counters_write_snapshots_but_no_score(catalog_db):
    a = catalog_db.card(views=0)
    p = catalog_db.card(views=0, kind="Project")
    s = assert_ok(run())
    assert s["snapshots_written"] == 2
    assert s["property_object_cards_updated"] == s["project_cards_updated"] == 0
    assert (
        catalog_db.q("SELECT updated_at FROM catalog.property_object_cards WHERE id = %s", a)[0][
            0
        ].year
        == 2026
    )
    assert catalog_db.snapshots(p) == [(D, 0)]


def test_decay_example_gives_30_5084(catalog_db):
    cid = catalog_db.card(views=135)
    for days, views in ((3, 100), (2, 125), (1, 125)):  # deltas: 25 (age 2), 0 (age 1)
        catalog_db.seed_snapshot(cid, D - timedelta(days=days), views)
    s = assert_ok(run())  # today's snapshot 135: delta 10 at age 0
    assert catalog_db.score(cid) == Decimal("30.5084")
    assert s["property_object_cards_updated"] == 1
    assert reference_score(
        {
            D - timedelta(days=3): 100,
            D - timedelta(days=2): 125,
            D - timedelta(days=1): 125,
            D: 135,
        },
        D,
        30,
        7,
    ) == Decimal("30.5084")


def test_first_snapshot_is_a_baseline(catalog_db):
    big = catalog_db.card(views=5_000_000)
    assert_ok(run())
    assert catalog_db.score(big) == 0
    assert catalog_db.snapshots(big) == [(D, 5_000_000)]


@pytest.mark.long
def test_first_nights_keep_the_platform_scores_until_the_window_is_covered(catalog_db):
    """A platform switching to the job has scores and no snapshot history: the first night keeps
    every score (its window has no history yet), the next nights add the decayed inherited score
    to what the history shows, and once the history covers the window the score is the formula
    alone; the inherited scores are pruned with the snapshots' horizon. A dry run inherits
    nothing."""
    inherited = catalog_db.card(views=1000, score=42.5)
    project = catalog_db.card(views=50, kind="Project", score=7)
    fresh = catalog_db.card(views=10)  # score 0: nothing to keep
    assert_ok(run({"dry_run": True}))
    assert catalog_db.one("SELECT count(*) FROM pin_nightly.popularity_inherited") == 0
    s = assert_ok(run())
    assert s["snapshots_written"] == 3 and s["property_object_cards_updated"] == 0
    assert catalog_db.score(inherited) == Decimal("42.5000")
    assert catalog_db.score(project, "Project") == Decimal("7.0000")
    assert catalog_db.score(fresh) == 0
    d1 = D + timedelta(days=1)
    catalog_db.q(
        "UPDATE catalog.property_object_cards SET popularity_views = 1100 WHERE id = %s", inherited
    )
    assert_ok(run(as_of=d1))
    assert_ok(run(as_of=d1))  # a re-run of the date keeps what the first night inherited
    snaps = dict(catalog_db.snapshots(inherited))
    assert catalog_db.score(inherited) == reference_score(snaps, d1, 30, 7, (42.5, D))
    assert catalog_db.score(inherited) == Decimal("138.4933")  # 100 + 42.5 * 2^(-1/7)
    assert catalog_db.score(project, "Project") == reference_score(
        dict(catalog_db.snapshots(project)), d1, 30, 7, (7, D)
    )
    covered = D + timedelta(days=30)  # D's snapshots now cover the window: the formula alone
    assert_ok(run(as_of=covered))
    snaps = dict(catalog_db.snapshots(inherited))
    assert catalog_db.score(inherited) == reference_score(snaps, covered, 30, 7)
    # the cards with a score to keep (not the one at 0)
    assert catalog_db.one("SELECT count(*) FROM pin_nightly.popularity_inherited") == 2
    assert_ok(run(as_of=covered + timedelta(days=3)))  # past the horizon: pruned
    assert catalog_db.one("SELECT count(*) FROM pin_nightly.popularity_inherited") == 0


def test_rerun_of_a_date_is_idempotent(catalog_db):
    cid = catalog_db.card(views=100)
    assert_ok(run(as_of=D - timedelta(days=1)))
    catalog_db.set_views(cid, 130)
    s1 = assert_ok(run())
    assert catalog_db.score(cid) == Decimal("30.0000")  # delta 30 at weight 1
    before = catalog_db.q(
        "SELECT id, popularity_score, updated_at FROM catalog.property_object_cards"
    )
    s2 = assert_ok(run())
    assert (
        catalog_db.q("SELECT id, popularity_score, updated_at FROM catalog.property_object_cards")
        == before
    )
    assert catalog_db.snapshots(cid) == [(D - timedelta(days=1), 100), (D, 130)]
    assert s1["property_object_cards_updated"] == 1 and s2["property_object_cards_updated"] == 0
    assert s2["snapshots_written"] == 1  # upserted, not duplicated


def test_snapshot_ids_are_time_ordered_and_kept_by_a_rerun(catalog_db):
    for _ in range(3):
        catalog_db.card(views=10)
    t0 = datetime.now(UTC)
    assert_ok(run(as_of=D - timedelta(days=1)))
    assert_ok(run())
    t1 = datetime.now(UTC)
    rows = catalog_db.q(
        "SELECT run_date, id::text FROM catalog.popularity_daily_views ORDER BY run_date, id"
    )
    ids = [uuid.UUID(i) for _, i in rows]
    assert len(ids) == 6 and {u.version for u in ids} == {7}
    # uuid v7: the first 48 bits are the unix milliseconds of the write
    assert all(int(t0.timestamp() * 1000) <= u.int >> 80 <= t1.timestamp() * 1000 for u in ids)
    assert max(ids[:3]) < min(ids[3:])  # a later night sorts after an earlier one
    before = catalog_db.q("SELECT id, card_id, run_date FROM catalog.popularity_daily_views")
    assert_ok(run())
    assert sorted(
        catalog_db.q("SELECT id, card_id, run_date FROM catalog.popularity_daily_views")
    ) == sorted(before)


@pytest.mark.long
def test_a_card_without_new_views_decays_to_zero_past_the_window(catalog_db):
    w, h = 4, 2
    cid = catalog_db.card(views=50)
    catalog_db.seed_snapshot(cid, D - timedelta(days=1), 10)
    scores = []
    for n in range(w + 1):  # nights D .. D+w, the counter stays at 50
        assert_ok(run({"window_days": w, "half_life_days": h}, as_of=D + timedelta(days=n)))
        scores.append(catalog_db.score(cid))
    lam = Decimal(2) ** (Decimal(-1) / Decimal(h))
    assert scores[0] == Decimal(40)
    for n in range(1, w):
        assert scores[n] < scores[n - 1]
        assert scores[n] == (40 * lam**n).quantize(Decimal("0.0001"))
    assert scores[w] == 0  # the growth day left the window


def test_missed_nights_put_the_growth_on_the_first_night_after(catalog_db):
    cid = catalog_db.card(views=160)
    catalog_db.seed_snapshot(cid, D - timedelta(days=4), 90)
    catalog_db.seed_snapshot(cid, D - timedelta(days=3), 100)  # D-2 and D-1 missed
    assert_ok(run())
    assert catalog_db.score(cid) == Decimal("60.0000") + (
        Decimal(10) * Decimal(2) ** (Decimal(-3) / 7)
    ).quantize(Decimal("0.0001"))


def test_an_older_as_of_date_writes_nothing(catalog_db):
    cid = catalog_db.card(views=500, score=12.5)
    catalog_db.seed_snapshot(cid, D, 400)
    catalog_db.seed_snapshot(cid, D - timedelta(days=40), 1)
    s = assert_ok(run(as_of=D - timedelta(days=2)))
    assert "nothing written" in s["status"]
    assert s["snapshots_written"] == 0 and s["snapshots_pruned"] == 0
    assert catalog_db.snapshots(cid) == [(D - timedelta(days=40), 1), (D, 400)]
    assert catalog_db.score(cid) == Decimal("12.5")


def test_retention_and_delisted_cards(catalog_db):
    cid = catalog_db.card(views=1000)
    gone = catalog_db.card(views=70, status="Delisted", score=3)
    for age in range(1, 41):
        catalog_db.seed_snapshot(cid, D - timedelta(days=age), 1000 - age)
    catalog_db.seed_snapshot(gone, D - timedelta(days=1), 60)
    s = assert_ok(run())
    dates = [d for d, _ in catalog_db.snapshots(cid)]
    assert min(dates) == D - timedelta(days=32) and len(dates) == 33  # W + 2 kept, plus today
    assert s["snapshots_pruned"] == 40 - 32
    assert catalog_db.score(gone) == 3  # a Delisted card is not recomputed
    assert catalog_db.snapshots(gone) == [(D - timedelta(days=1), 60)]


def _slow_vacuum_of_the_snapshots(catalog_db) -> SlowVacuum:
    """A slowed VACUUM of catalog.popularity_daily_views over 3,000 kept snapshots of other
    cards, running."""
    catalog_db.q(
        "INSERT INTO catalog.popularity_daily_views (card_kind, card_id, run_date, "
        "cumulative_views) SELECT 'PropertyObject', gen_random_uuid(), %s::date - 1, i "
        "FROM generate_series(1, 3000) i",
        D,
    )
    return SlowVacuum(catalog_db.dsn, "catalog.popularity_daily_views").start()


def _retention_lease(conf: dict, run_id: str) -> tuple[dict, dict]:
    """The options of a run of D with ``conf`` and the lease it took (as its XCom)."""
    from pin_nightly import catalog, jobs

    set_clock(D)  # night D, as of D
    opts = catalog.validate_options(conf, night(D), run_id)
    lease = jobs.acquire_lease(catalog.JOB, opts, run_id)
    assert lease["acquired"], lease
    return opts, lease


def _deadline_in(catalog_db, interval: str) -> None:
    """The lease's run deadline moved to ``interval`` from now."""
    from pin_nightly import catalog

    catalog_db.q(
        "UPDATE pin_nightly.job_lease SET run_deadline_at = clock_timestamp() + %s::interval "
        "WHERE lock_key = %s",
        interval,
        catalog.JOB.lock_key,
    )


def _old_snapshots(catalog_db) -> int:
    return catalog_db.one(
        "SELECT count(*) FROM catalog.popularity_daily_views WHERE run_date < %s::date - 32", D
    )


def test_retention_deletes_in_short_batches_and_waits_while_a_vacuum_runs(
    catalog_db, monkeypatch, capfd, caplog
):
    """Retention drops a night's partition a transaction and paces before each as a range
    does: while a VACUUM runs on the snapshot table it drops nothing; once the VACUUM is
    cancelled it drops every night past the horizon, and none it keeps."""
    from pin_nightly import catalog, runs

    cards = [catalog_db.card(views=100) for _ in range(3)]
    for cid in cards:
        for age in range(1, 41):
            catalog_db.seed_snapshot(cid, D - timedelta(days=age), 100 - age)
    old = _old_snapshots(catalog_db)
    assert old == 3 * 8
    vacuum = _slow_vacuum_of_the_snapshots(catalog_db)
    opts, lease = _retention_lease({"pace_on_vacuum": True}, "retention-vacuum")
    seen: dict = {}
    watcher = vacuum.cancel_after(1.5, lambda: seen.update(during=_old_snapshots(catalog_db)))
    try:
        pruned = catalog.retention(runs.Run.of(catalog.JOB, opts, "test", lease))
    finally:
        watcher.join(15)
        runs.release_lease(runs.Run.of(catalog.JOB, {}, "", lease))
    assert seen["during"] == old  # nothing deleted while the VACUUM ran
    assert pruned == old and _old_snapshots(catalog_db) == 0
    for cid in cards:
        assert [d for d, _ in catalog_db.snapshots(cid)] == [
            D - timedelta(days=age) for age in range(32, 0, -1)
        ]
    text = capfd.readouterr().out + caplog.text
    assert f"pausing: vacuum=running (catalog.popularity_daily_views pid {vacuum.pid}" in text
    assert "retention resumes after" in text


def test_retention_paused_past_the_deadline_deletes_the_oldest_night_and_the_next_the_rest(
    catalog_db, capfd, caplog
):
    """A VACUUM that outlasts the run's deadline: retention deletes only the oldest night past
    the horizon (the table never grows by more than a night), the run is not failed, and a
    later retention prunes everything else past the horizon."""
    from pin_nightly import catalog, runs

    cid = catalog_db.card(views=100)
    for age in range(1, 41):
        catalog_db.seed_snapshot(cid, D - timedelta(days=age), 100 - age)
    vacuum = _slow_vacuum_of_the_snapshots(catalog_db)
    opts, lease = _retention_lease({"pace_on_vacuum": True}, "retention-deadline")
    _deadline_in(catalog_db, "1 s")
    try:
        assert catalog.retention(runs.Run.of(catalog.JOB, opts, "test", lease)) == 1
    finally:
        vacuum.cancel()
        runs.release_lease(runs.Run.of(catalog.JOB, {}, "", lease))
    text = capfd.readouterr().out + caplog.text
    assert "retention: budget spent while paused (vacuum=running" in text
    oldest = D - timedelta(days=40)
    assert f"drops the oldest night past the horizon ({oldest}) and leaves the rest" in text
    assert _old_snapshots(catalog_db) == 7 and oldest not in dict(catalog_db.snapshots(cid))
    opts, lease = _retention_lease({"pace_on_vacuum": True}, "retention-next")
    try:
        assert catalog.retention(runs.Run.of(catalog.JOB, opts, "test", lease)) == 7
    finally:
        runs.release_lease(runs.Run.of(catalog.JOB, {}, "", lease))
    assert _old_snapshots(catalog_db) == 0


def test_retention_past_the_deadline_drops_the_empty_nights_before_the_oldest_with_snapshots(
    catalog_db,
):
    """Past the run's deadline, when the oldest partitions past the horizon are empty (nights
    made ahead that no run wrote, across a gap), retention drops them and then the oldest night
    that holds snapshots, and stops there: the table still shrinks by a night."""
    from pin_nightly import catalog, runs

    cid = catalog_db.card(views=100)
    catalog_db.partition(D - timedelta(days=52), D - timedelta(days=46))  # a week, empty
    for age in (45, 44, 1):
        catalog_db.seed_snapshot(cid, D - timedelta(days=age), 100 - age)
    opts, lease = _retention_lease({}, "retention-empty-nights")
    _deadline_in(catalog_db, "-1 s")  # passed
    try:
        assert catalog.retention(runs.Run.of(catalog.JOB, opts, "test", lease)) == 1
    finally:
        runs.release_lease(runs.Run.of(catalog.JOB, {}, "", lease))
    kept = [d for d, _ in catalog_db.snapshots(cid)]
    assert kept == [D - timedelta(days=44), D - timedelta(days=1)], kept
    first = catalog_db.one("SELECT min(lower_bound) FROM catalog.popularity_partitions()")
    assert first == D - timedelta(days=44), first


def test_retention_failing_between_drops_keeps_what_it_dropped_and_its_retry_prunes_the_rest(
    catalog_db, monkeypatch
):
    """The connection lost after retention dropped its second partition (a night of three
    snapshots each): the task fails, the two nights stay dropped and nothing else is; run
    again (the task cleared), retention prunes exactly the rest."""
    from pin_nightly import catalog, runs
    from pin_nightly import lease as leases
    from pin_nightly.db import DatabaseUnavailable

    cards = [catalog_db.card(views=100) for _ in range(3)]
    for cid in cards:
        for age in range(1, 41):
            catalog_db.seed_snapshot(cid, D - timedelta(days=age), 100 - age)
    kept = catalog_db.one("SELECT count(*) FROM catalog.popularity_daily_views") - 24
    fences = [0]
    real_fence = leases.fence

    def fence(cur, lease, *args):
        fences[0] += 1
        if fences[0] == 3:
            raise DatabaseUnavailable("connection lost")
        return real_fence(cur, lease, *args)

    monkeypatch.setattr(leases, "fence", fence)
    opts, lease = _retention_lease({}, "retention-fails")
    try:
        with pytest.raises(DatabaseUnavailable):
            catalog.retention(runs.Run.of(catalog.JOB, opts, "test", lease))
        assert _old_snapshots(catalog_db) == 24 - 2 * 3
        monkeypatch.setattr(leases, "fence", real_fence)
        assert catalog.retention(runs.Run.of(catalog.JOB, opts, "test", lease)) == 24 - 2 * 3
    finally:
        runs.release_lease(runs.Run.of(catalog.JOB, {}, "", lease))
    assert _old_snapshots(catalog_db) == 0
    assert catalog_db.one("SELECT count(*) FROM catalog.popularity_daily_views") == kept


def test_poison_rows_are_excluded_and_the_batch_commits(catalog_db, capfd, caplog):
    good = catalog_db.card(views=10)
    null = catalog_db.card(views=None)
    negative = catalog_db.card(views=-5, kind="Project")
    huge = catalog_db.card(views=10**12, score=1)
    catalog_db.seed_snapshot(good, D - timedelta(days=1), 4)
    catalog_db.seed_snapshot(huge, D - timedelta(days=1), 0)
    capfd.readouterr()
    r = run()
    s = assert_ok(r)
    out = capfd.readouterr()
    text = out.out + out.err + caplog.text
    assert f"run started: run={r['run_id']} as_of_date={D}" in text  # the log names the run
    assert s["item_errors"] == 3
    assert catalog_db.score(good) == 6
    assert catalog_db.score(huge) == 1  # 10**12 does not fit numeric(12,4): not written
    assert catalog_db.snapshots(null) == [] and catalog_db.snapshots(negative) == []
    for kind, cid in (("PropertyObject", null), ("Project", negative), ("PropertyObject", huge)):
        assert f"card_kind={kind} card_id={cid}" in text


def test_card_ids_recompute_only_those_cards(catalog_db):
    a = catalog_db.card(views=20)
    b = catalog_db.card(views=20)
    p = catalog_db.card(views=20, kind="Project")
    for cid, kind in ((a, "PropertyObject"), (b, "PropertyObject"), (p, "Project")):
        catalog_db.seed_snapshot(cid, D - timedelta(days=1), 5, kind=kind)
    s = assert_ok(run({"card_ids": [a, p]}))
    assert (catalog_db.score(a), catalog_db.score(b), catalog_db.score(p, "Project")) == (15, 0, 15)
    assert catalog_db.snapshots(b) == [(D - timedelta(days=1), 5)]
    assert s["property_object_cards_updated"] == 1 and s["project_cards_updated"] == 1


def test_dry_run_writes_nothing(catalog_db):
    a = catalog_db.card(views=20)
    catalog_db.seed_snapshot(a, D - timedelta(days=1), 5)
    catalog_db.seed_snapshot(a, D - timedelta(days=45), 1)
    s = assert_ok(run({"dry_run": True}))
    assert s["dry_run_report"] == {
        "property_object_cards_updated": 1,
        "project_cards_updated": 0,
        "snapshots_written": 1,
        "snapshots_pruned": 1,
    }
    assert s["property_object_cards_updated"] == s["snapshots_written"] == 0
    assert catalog_db.score(a) == 0
    assert len(catalog_db.snapshots(a)) == 2


@pytest.mark.long
def test_scores_match_an_independent_computation_over_a_random_month(catalog_db):
    rnd = random.Random(20261130)
    w, h = 30, 7
    cards, history = [], {}
    for i in range(60):
        kind = "Project" if i % 5 == 0 else "PropertyObject"
        cid = catalog_db.card(views=0, kind=kind)
        views, snaps = rnd.randint(0, 500), {}
        for age in range(45, 2, -1):  # nights D-45 .. D-3, some missed
            views += rnd.choice((0, 0, 1, 3, 10, 50, rnd.randint(0, 400)))
            if rnd.random() < 0.85:
                snaps[D - timedelta(days=age)] = views
                catalog_db.seed_snapshot(cid, D - timedelta(days=age), views, kind=kind)
        if rnd.random() < 0.1:  # a replay/reset: the counter went down
            views = max(0, views - rnd.randint(1, 100))
        cards.append((cid, kind, views, snaps))
        history[cid] = snaps
    # three real nights through the DAG, the counters growing in between
    for n in (2, 1, 0):
        d = D - timedelta(days=n)
        for idx, (cid, kind, views, snaps) in enumerate(cards):
            views += rnd.choice((0, 2, 7, 120))
            catalog_db.set_views(cid, views, kind)
            snaps[d] = views
            cards[idx] = (cid, kind, views, snaps)
        assert_ok(run({"batch_size": 7}, as_of=d))
    for cid, kind, _, snaps in cards:
        assert catalog_db.score(cid, kind) == reference_score(snaps, D, w, h), cid


def _cards_and_sweep(catalog_db, n: int, batch_size: int):
    """n cards, a lease and a planned two-range sweep, as the DAG's tasks would make them."""
    from pin_nightly import catalog, jobs, sweeps
    from pin_nightly import lease as leases
    from pin_nightly.db import connection

    catalog_db.set_today(D)
    ids = [catalog_db.card(views=i) for i in range(n)]
    for i, cid in enumerate(ids):
        catalog_db.seed_snapshot(cid, D - timedelta(days=1), max(0, i - 3))
    catalog_db.partition(D)  # as the planning of tonight's passes creates it
    opts = {
        **catalog.DEFAULTS,
        "as_of_date": D.isoformat(),
        "batch_size": batch_size,
        "max_ranges": 2,
    }
    with connection("catalog_db") as conn:
        jobs.preflight(conn, catalog.JOB)
        lease = leases.acquire(conn, catalog.JOB.lock_key, "test/parallel", 10, 5)
        spec = sweeps.SweepSpec(
            job=catalog.JOB.code,
            family="PropertyObject",
            as_of_date=str(D),
        )
        sweep = sweeps.open_sweep(
            conn,
            spec,
            lease,
            "test/parallel",
            lambda cur, s: sweeps.boundaries(
                cur,
                catalog.card_sql("source", "PropertyObject").strip(),
                {"targeted": False, "card_ids": []},
                batch_size,
                2,
            ),
        )
    return ids, opts, lease, sweeps.range_descriptors(sweep, "PropertyObject")


def test_two_parallel_workers_recompute_each_card_exactly_once(catalog_db):
    from pin_nightly import catalog
    from pin_nightly import ranges as keyset_ranges
    from pin_nightly.db import connection

    ids, opts, lease, ranges = _cards_and_sweep(catalog_db, 400, 25)
    assert len(ranges) == 2
    results, errors = [], []

    def worker(rng):
        try:
            with connection("catalog_db") as conn:
                results.append(
                    keyset_ranges.run_range(
                        conn,
                        rng,
                        lease,
                        25,
                        catalog.make_batch("PropertyObject", opts, rng["sweep_id"], "test"),
                    )
                )
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(r,)) for r in ranges]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert sorted(r.processed for r in results) == [200, 200]
    assert sum(r.written for r in results) == 400
    assert (
        catalog_db.one("SELECT count(*) FROM catalog.popularity_daily_views WHERE run_date = %s", D)
        == 400
    )
    # each card's snapshot was written by exactly one transaction (no upsert over another)
    assert (
        catalog_db.one(
            "SELECT count(*) FROM catalog.popularity_daily_views "
            "WHERE run_date = %s AND xmin::text::bigint IN (SELECT xmin::text::bigint "
            "FROM catalog.popularity_daily_views WHERE run_date = %s "
            "GROUP BY 1 HAVING count(*) > 25)",
            D,
            D,
        )
        == 0
    )
    for i, cid in enumerate(ids):
        assert catalog_db.score(cid) == min(i, 3)


def test_consumer_increments_during_a_run_are_never_lost_or_torn(catalog_db):
    hot = [catalog_db.card(views=1000) for _ in range(5)]
    cold = [catalog_db.card(views=10) for _ in range(300)]
    for cid in hot + cold:
        catalog_db.seed_snapshot(cid, D - timedelta(days=1), 0)
    # the view consumer: increments on the hot cards only, autocommit (tools/hot_path/)
    with pgbench.PgBench(catalog_db.dsn, pgbench.VIEWS, hot, clients=1) as consumer:
        s = assert_ok(run({"batch_size": 10}))
    assert consumer.result.failures == [] and consumer.result.committed > 0
    final = {
        cid: catalog_db.one(
            "SELECT popularity_views FROM catalog.property_object_cards WHERE id = %s", cid
        )
        for cid in hot
    }
    assert sum(final.values()) == 5 * 1000 + consumer.result.committed  # none lost
    for cid in hot:
        [(d, snap)] = [x for x in catalog_db.snapshots(cid) if x[0] == D]
        assert 1000 <= snap <= final[cid]  # a value the counter really had
        assert catalog_db.score(cid) == snap  # the score matches that snapshot
    assert s["property_object_cards_processed"] + s["property_object_cards_skipped_locked"] == 305
    # re-running the date with the consumer stopped takes the settled counters
    assert_ok(run({"batch_size": 10}))
    for cid in hot:
        assert catalog_db.score(cid) == final[cid]


# enough batches of 5 that the stop lands mid-run however fast a batch is
N_STOP = 400


def test_stopping_mid_run_keeps_whole_batches_and_releases_locks(catalog_db):
    ids = [catalog_db.card(views=7) for _ in range(N_STOP)]
    for cid in ids:
        catalog_db.seed_snapshot(cid, D - timedelta(days=1), 2)
    when(
        lambda: (
            catalog_db.one("SELECT coalesce(sum(batches), 0) FROM pin_nightly.sweep_range") >= 2
        ),
        lambda: os.kill(os.getpid(), signal.SIGTERM),
    )
    r = run({"batch_size": 5, "max_ranges": 1})
    assert r["state"] == "failed"
    written = catalog_db.one(
        "SELECT count(*) FROM catalog.popularity_daily_views WHERE run_date = %s", D
    )
    scored = catalog_db.one(
        "SELECT count(*) FROM catalog.property_object_cards WHERE popularity_score = 5"
    )
    assert written == scored and written % 5 == 0 and 10 <= written < N_STOP
    # no row lock is left behind
    with psycopg.connect(catalog_db.dsn) as conn:
        conn.execute("SET lock_timeout = '1s'")
        assert (
            len(
                conn.execute(
                    "SELECT id FROM catalog.property_object_cards FOR UPDATE NOWAIT"
                ).fetchall()
            )
            == N_STOP
        )
    s = assert_ok(run({"batch_size": 5, "max_ranges": 1}))
    assert s["property_object_cards_processed"] == N_STOP - written  # resumed from the cursor
    assert (
        catalog_db.one(
            "SELECT count(*) FROM catalog.property_object_cards WHERE popularity_score = 5"
        )
        == N_STOP
    )


# --- statement 1 computes without row locks, statement 2 locks and writes ----------------------

PO = "catalog.property_object_cards"
INCREMENT = f"UPDATE {PO} SET popularity_views = popularity_views + %s WHERE id = %s"


def _between_statements(monkeypatch, action, every: bool = False) -> dict:
    """Run ``action(ids)`` in the job's batch transaction between its statement 1
    (``catalog/compute``, which has read the batch's cards ``ids``) and its statement 2
    (``catalog/apply``): for the first batch that read cards, or for every batch. ``dag.test``
    runs the tasks in this process, so the patched method is what the range task calls."""
    from pin_nightly import catalog

    real = catalog.Recompute._write
    state = {"calls": 0}

    def _write(self, cur, rows, limit):
        if rows and (every or not state["calls"]):
            state["calls"] += 1
            action([r["id"] for r in rows])
        return real(self, cur, rows, limit)

    monkeypatch.setattr(catalog.Recompute, "_write", _write)
    return state


def test_a_batch_holds_no_card_lock_while_it_computes_and_its_locks_only_while_it_writes(
    catalog_db, monkeypatch
):
    """Between the batch's two statements (its values computed, nothing written yet) no card of
    the batch is locked: FOR NO KEY UPDATE NOWAIT takes each, and the view consumer's increment
    of each goes through at once under a 100 ms lock_timeout. During statement 2 (held in
    flight by a trigger that waits on the last card's update for an advisory lock the test
    holds) every card of the batch is locked and an increment gives up after its 100 ms. The
    snapshot is the counter statement 1 read, the score is computed from it, and no increment
    is lost."""
    from psycopg.errors import LockNotAvailable

    from tests.helpers import ADVISORY_KEY, gate_waiter, install_gate, wait_for

    ids = [catalog_db.card(views=100 + i) for i in range(8)]
    for cid in ids:
        catalog_db.seed_snapshot(cid, D - timedelta(days=1), 50)
    install_gate(catalog_db, PO, ids[-1])
    gate = psycopg.connect(catalog_db.dsn, autocommit=True)
    seen: dict = {"taken": [], "increment_s": [], "locked_while_writing": [], "error": None}

    def while_writing():
        try:
            wait_for(lambda: gate_waiter(catalog_db), timeout=120, what="statement 2 at the gate")
            with psycopg.connect(catalog_db.dsn, autocommit=True) as conn:
                conn.execute("SET lock_timeout = '100ms'")
                for cid in ids:
                    try:
                        conn.execute(INCREMENT, (1, cid))
                    except LockNotAvailable:
                        seen["locked_while_writing"].append(cid)
        except Exception as exc:  # noqa: BLE001 - reported below
            seen["error"] = repr(exc)
        finally:
            gate.execute("SELECT pg_advisory_unlock(%s)", (ADVISORY_KEY,))

    writer = threading.Thread(target=while_writing)

    def between(batch):
        seen["batch"] = batch
        with psycopg.connect(catalog_db.dsn, autocommit=True) as conn:
            conn.execute("SET lock_timeout = '100ms'")
            for cid in batch:
                with conn.transaction():
                    lock = f"SELECT id::text FROM {PO} WHERE id = %s FOR NO KEY UPDATE NOWAIT"
                    seen["taken"] += [r[0] for r in conn.execute(lock, (cid,))]
                t0 = time.monotonic()
                conn.execute(INCREMENT, (1, cid))
                seen["increment_s"].append(time.monotonic() - t0)
        gate.execute("SELECT pg_advisory_lock(%s)", (ADVISORY_KEY,))
        writer.start()

    _between_statements(monkeypatch, between)
    try:
        s = assert_ok(run({"batch_size": 20}))
    finally:
        writer.join(150)
        gate.close()
    assert seen["error"] is None, seen["error"]
    assert seen["batch"] == ids
    assert seen["taken"] == ids  # no card of the batch was locked while it computed
    assert len(seen["increment_s"]) == 8, seen["increment_s"]  # none waited 100 ms
    assert seen["locked_while_writing"] == ids  # statement 2 held every card's lock
    for i, cid in enumerate(ids):
        assert catalog_db.snapshots(cid) == [(D - timedelta(days=1), 50), (D, 100 + i)]
        assert catalog_db.score(cid) == 50 + i
        assert catalog_db.one(f"SELECT popularity_views FROM {PO} WHERE id = %s", cid) == 101 + i
    assert s["property_object_cards_processed"] == 8 and s["item_errors"] == 0


def test_counters_moving_between_compute_and_write_give_a_snapshot_and_score_that_agree(
    catalog_db, monkeypatch
):
    """Counters that grow (or are reset lower) between a batch's statement 1 and statement 2,
    in every batch: each card's snapshot of the night is the counter statement 1 read, a value
    it had during the run, and its score is exactly the formula over its history with that
    snapshot (the independent reference); the growth is kept in the counter, and a re-run of
    the date, the counters settled, takes it."""
    rnd = random.Random(20261202)
    cards, history, moves = [], {}, {}
    for i in range(30):
        views, snaps = rnd.randint(0, 300), {}
        for age in range(35, 0, -1):
            views += rnd.choice((0, 1, 4, 30, rnd.randint(0, 200)))
            if rnd.random() < 0.9:
                snaps[D - timedelta(days=age)] = views
        views += rnd.randint(0, 80)
        cid = catalog_db.card(views=views)
        for d, v in snaps.items():
            catalog_db.seed_snapshot(cid, d, v)
        cards.append((cid, views))
        history[cid] = snaps
        # most grow, one in ten is reset lower (a replay), some stay
        moves[cid] = rnd.choice((0, 1, 7, 250)) if i % 10 else -min(views, 5)

    def between(batch):
        with psycopg.connect(catalog_db.dsn, autocommit=True) as conn:
            conn.execute("SET lock_timeout = '100ms'")
            for cid in batch:
                conn.execute(INCREMENT, (moves[cid], cid))

    state = _between_statements(monkeypatch, between, every=True)
    s = assert_ok(run({"batch_size": 4}))
    assert state["calls"] == 8  # 30 cards in batches of 4
    assert s["property_object_cards_processed"] == 30 and s["item_errors"] == 0
    for cid, views in cards:
        assert dict(catalog_db.snapshots(cid))[D] == views, cid  # read by statement 1
        assert catalog_db.score(cid) == reference_score({**history[cid], D: views}, D, 30, 7), cid
        now = catalog_db.one(f"SELECT popularity_views FROM {PO} WHERE id = %s", cid)
        assert now == views + moves[cid], cid  # the consumer's change is kept
    monkeypatch.undo()
    assert_ok(run({"batch_size": 4}))
    for cid, views in cards:
        settled = views + moves[cid]
        assert dict(catalog_db.snapshots(cid))[D] == settled, cid
        assert catalog_db.score(cid) == reference_score({**history[cid], D: settled}, D, 30, 7)


def test_cards_delisted_deleted_or_locked_between_compute_and_write(catalog_db, monkeypatch):
    """Between a batch's statement 1 and statement 2: a card Delisted gets no snapshot and no
    score (statement 2 checks the status on the locked row), a deleted card nothing; a card
    whose counter becomes NULL keeps the valid value statement 1 read; a card a consumer's
    transaction holds is skipped by statement 2 and taken by the range's retry at its end once
    that transaction commits, with a snapshot and a score that agree."""
    ids = [catalog_db.card(views=40 + i, score=1) for i in range(6)]
    for cid in ids:
        catalog_db.seed_snapshot(cid, D - timedelta(days=1), 30)
    delisted, deleted, nulled, held = ids[1], ids[2], ids[3], ids[4]
    blocker = psycopg.connect(catalog_db.dsn)

    def between(batch):
        with psycopg.connect(catalog_db.dsn, autocommit=True) as conn:
            conn.execute(f"UPDATE {PO} SET status = 'Delisted' WHERE id = %s", (delisted,))
            conn.execute(f"DELETE FROM {PO} WHERE id = %s", (deleted,))
            conn.execute(f"UPDATE {PO} SET popularity_views = NULL WHERE id = %s", (nulled,))
        blocker.execute(INCREMENT, (5, held))  # open: statement 2 must skip this card
        # the consumer commits once the batch has committed: the range's retry takes the card
        when(
            lambda: (
                catalog_db.one("SELECT coalesce(sum(batches), 0) FROM pin_nightly.sweep_range") >= 1
            ),
            blocker.commit,
        )

    _between_statements(monkeypatch, between)
    try:
        s = assert_ok(run({"batch_size": 20}))
    finally:
        blocker.close()
    assert catalog_db.snapshots(delisted) == [(D - timedelta(days=1), 30)]
    assert catalog_db.score(delisted) == 1
    assert catalog_db.snapshots(deleted) == [(D - timedelta(days=1), 30)]  # none of D
    assert catalog_db.snapshots(nulled) == [(D - timedelta(days=1), 30), (D, 43)]
    assert catalog_db.score(nulled) == 13
    [(_, snap)] = [x for x in catalog_db.snapshots(held) if x[0] == D]
    assert snap in (44, 49)  # before or after the consumer's +5: a value it had in the run
    assert catalog_db.score(held) == snap - 30
    for cid in (ids[0], ids[5]):
        assert catalog_db.score(cid) == catalog_db.snapshots(cid)[-1][1] - 30
    assert s["property_object_cards_skipped_locked"] == 0
    assert s["property_object_cards_processed"] == 4  # the Delisted and the deleted are not
    assert s["snapshots_written"] == 4 and s["item_errors"] == 0
    # the held card was written by the retry's own transaction, not by the batch's
    xmin = (
        "SELECT xmin::text FROM catalog.popularity_daily_views WHERE card_id = %s AND run_date = %s"
    )
    assert catalog_db.one(xmin, held, D) != catalog_db.one(xmin, ids[0], D)


def test_a_remembered_card_is_taken_first_the_next_night(catalog_db):
    """A card held through a night's end-of-range retry is remembered; the next night, the range
    whose keyset holds it takes it before its batches: a budget that ends after the first batch
    still writes it (the batches never reach it, the newest id) and forgets it, and no batch
    writes it twice."""
    from tests.helpers import budget_spent_after_each_batch

    cards = [catalog_db.card(views=10 * (i + 1)) for i in range(6)]
    held = cards[-1]  # the newest id: the last one the keyset reaches
    for c in cards:
        catalog_db.seed_snapshot(c, D - timedelta(days=2), 5)
    remembered = "SELECT card_id::text FROM pin_nightly.popularity_skipped_card"
    with psycopg.connect(catalog_db.dsn) as blocker:
        blocker.execute(INCREMENT, (1, held))  # held, uncommitted, for the whole run
        s = assert_ok(run({"batch_size": 2}, as_of=D - timedelta(days=1)))
        assert s["cards_unscored"] == 1 and catalog_db.q(remembered) == [(held,)], s
    with budget_spent_after_each_batch(catalog_db):
        s = assert_ok(run({"batch_size": 2, "max_ranges": 1}))
    assert s["status"] == "backlog_remaining", s
    assert catalog_db.snapshots(held)[-1] == (D, 61)
    assert catalog_db.score(held) == reference_score(dict(catalog_db.snapshots(held)), D, 30, 7)
    assert catalog_db.snapshots(cards[3])[-1][0] < D  # the keyset did not get that far
    assert catalog_db.q(remembered) == [] and s["cards_unscored"] == 0
    assert s["property_object_cards_processed"] == 3  # the first batch's two, and the held one


def test_a_card_held_through_the_run_keeps_its_earlier_snapshot_of_the_date(catalog_db):
    """A re-run of a date while a consumer's transaction holds a card from before the run to
    after it: statement 2 upserts the card's snapshot, cannot lock the card, and puts the
    snapshot the earlier run wrote back (value and created_at) before the commit; the range's
    retry gives up after its lock_timeout. The card is reported skipped, its snapshot and score
    stay the earlier run's pair, and it is remembered (the summary's and the gauge's
    cards_unscored); once the transaction commits, the next run takes it and forgets it."""
    held, other = catalog_db.card(views=80, score=20), catalog_db.card(views=90, score=0)
    for cid in (held, other):
        catalog_db.seed_snapshot(cid, D - timedelta(days=1), 30)
        catalog_db.seed_snapshot(cid, D, 50)  # an earlier run of the date
    row = "SELECT id, cumulative_views, created_at FROM catalog.popularity_daily_views "
    row += "WHERE card_id = %s AND run_date = %s"
    before = catalog_db.q(row, held, D)
    with psycopg.connect(catalog_db.dsn) as blocker:
        blocker.execute(INCREMENT, (1, held))  # held, uncommitted, for the whole run
        s = assert_ok(run({"batch_size": 20}))
        assert catalog_db.q(row, held, D) == before
        assert catalog_db.score(held) == 20
        assert catalog_db.snapshots(other)[-1] == (D, 90) and catalog_db.score(other) == 60
        assert s["property_object_cards_skipped_locked"] == 1
        assert s["property_object_cards_processed"] == 1 and s["snapshots_written"] == 1
        assert s["cards_unscored"] == 1
        remembered = (
            "SELECT card_kind, card_id::text, as_of FROM pin_nightly.popularity_skipped_card"
        )
        assert catalog_db.q(remembered) == [("PropertyObject", held, D)]
    s = assert_ok(run({"batch_size": 20}))
    assert catalog_db.snapshots(held)[-1] == (D, 81) and catalog_db.score(held) == 51
    assert s["property_object_cards_skipped_locked"] == 0
    assert s["cards_unscored"] == 0 and catalog_db.q(remembered) == []
    # taken first, then left by the batch that reads it: each card counted once
    assert s["property_object_cards_processed"] == 2 and s["snapshots_written"] == 2, s
