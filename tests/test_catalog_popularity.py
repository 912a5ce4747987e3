"""catalog_popularity_recompute end to end: real Airflow (dag.test) on a real PostgreSQL."""

from __future__ import annotations

import os
import random
import signal
import threading
import uuid
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import psycopg

from tests.helpers import assert_ok, night, when
from tests.helpers import reference_popularity_score as reference_score
from tools import pgbench
from tools.rundag import run_dag

DAG = "catalog_popularity_recompute"
D = date(2026, 8, 31)  # a Monday, far enough back that every night a test runs is past


def run(conf=None, as_of: date = D, **kw):
    return run_dag(DAG, conf, logical_date=night(as_of), **kw)


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
    from pin_nightly import catalog, jobs, keyset
    from pin_nightly import lease as leases
    from pin_nightly.db import connection

    ids = [catalog_db.card(views=i) for i in range(n)]
    for i, cid in enumerate(ids):
        catalog_db.seed_snapshot(cid, D - timedelta(days=1), max(0, i - 3))
    opts = {
        **catalog.DEFAULTS,
        "as_of_date": D.isoformat(),
        "batch_size": batch_size,
        "max_ranges": 2,
    }
    with connection("catalog_db") as conn:
        jobs.preflight(conn, catalog.JOB)
        lease = leases.acquire(conn, catalog.JOB.lock_key, "test/parallel", 10, 5)
        spec = keyset.SweepSpec(
            job=catalog.JOB.code,
            family="PropertyObject",
            resumable=True,
            as_of_date=str(D),
        )
        sweep = keyset.open_sweep(
            conn,
            spec,
            lease,
            "test/parallel",
            lambda cur, s: keyset.boundaries(
                cur,
                catalog.card_sql("source", "PropertyObject").strip(),
                {"targeted": False, "card_ids": []},
                batch_size,
                2,
            ),
        )
    return ids, opts, lease, keyset.range_descriptors(sweep, "PropertyObject")


def test_two_parallel_workers_recompute_each_card_exactly_once(catalog_db):
    from pin_nightly import catalog, keyset
    from pin_nightly.db import connection

    ids, opts, lease, ranges = _cards_and_sweep(catalog_db, 400, 25)
    assert len(ranges) == 2
    results, errors = [], []

    def worker(rng):
        try:
            with connection("catalog_db") as conn:
                results.append(
                    keyset.run_range(
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


def test_stopping_mid_run_keeps_whole_batches_and_releases_locks(catalog_db):
    ids = [catalog_db.card(views=7) for _ in range(60)]
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
    assert written == scored and written % 5 == 0 and 10 <= written < 60
    # no row lock is left behind
    with psycopg.connect(catalog_db.dsn) as conn:
        conn.execute("SET lock_timeout = '1s'")
        assert (
            len(
                conn.execute(
                    "SELECT id FROM catalog.property_object_cards FOR UPDATE NOWAIT"
                ).fetchall()
            )
            == 60
        )
    s = assert_ok(run({"batch_size": 5, "max_ranges": 1}))
    assert s["property_object_cards_processed"] == 60 - written  # resumed from the cursor
    assert (
        catalog_db.one(
            "SELECT count(*) FROM catalog.property_object_cards WHERE popularity_score = 5"
        )
        == 60
    )
