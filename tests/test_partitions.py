"""The snapshot table's partitions (one a night): created ahead across month and year ends,
dropped by retention exactly past the horizon, and the online upgrade of the previous
release's table. Real Airflow (dag.test) on a real PostgreSQL."""

from __future__ import annotations

import threading
import time
from datetime import date, timedelta

import psycopg
import pytest

from tests.helpers import assert_ok, night
from tests.helpers import reference_popularity_score as reference_score
from tools.devenv import REPO
from tools.rundag import run_dag

DAG = "catalog_popularity_recompute"
D = date(2026, 8, 31)
HORIZON = 32
TABLE = "catalog.popularity_daily_views"


def partitions(db) -> dict[str, tuple]:
    return {
        name: (lo, hi)
        for name, lo, hi in db.q(
            "SELECT partition_name, lower_bound, upper_bound FROM catalog.popularity_partitions()"
        )
    }


def night_partition(d: date) -> str:
    return f"catalog.popularity_daily_views_p{d:%Y%m%d}"


def snapshots_by_partition(db, cid) -> dict:
    return dict(
        db.q(
            "SELECT run_date, tableoid::regclass::text FROM catalog.popularity_daily_views "
            "WHERE card_id = %s",
            cid,
        )
    )


@pytest.mark.long
def test_nights_across_month_ends_get_their_own_partitions(catalog_db):
    """Nights of 30 and 31 January, 1 February (2 February missed), 3 February, then 28
    February (no 29th in 2026) and 1 March: every night's snapshots live in its own
    partition, created by the run (and a week ahead), and every score is the formula's."""
    db = catalog_db
    cid = db.card(views=10)
    db.seed_snapshot(cid, date(2026, 1, 30), 4)
    views, nights = 10, (date(2026, 1, 31), date(2026, 2, 1), date(2026, 2, 3))
    for d in nights + (date(2026, 2, 28), date(2026, 3, 1)):
        views += 7
        db.set_views(cid, views)
        assert_ok(run_dag(DAG, {}, logical_date=night(d)))
        snaps = dict(db.snapshots(cid))
        assert d in snaps and db.score(cid) == reference_score(snaps, d, 30, 7), (d, snaps)
    parts = partitions(db)
    for d in (*nights, date(2026, 2, 2), date(2026, 2, 10), date(2026, 2, 28), date(2026, 3, 8)):
        assert parts[night_partition(d)] == (d, d + timedelta(days=1))
    assert night_partition(date(2026, 2, 11)) not in parts  # a week ahead of 3 February
    assert night_partition(date(2026, 3, 9)) not in parts
    assert snapshots_by_partition(db, cid) == {
        d: night_partition(d)
        for d in (date(2026, 1, 30), *nights, date(2026, 2, 28), date(2026, 3, 1))
    }
    # nights never overlap and none is made twice: a re-run of a date creates nothing
    assert_ok(run_dag(DAG, {}, logical_date=night(date(2026, 3, 1))))
    assert partitions(db) == parts
    bounds = sorted(parts.values())
    assert all(a[1] <= b[0] for a, b in zip(bounds, bounds[1:]))


def test_partitions_ahead_across_a_year_end(catalog_db):
    """The job's partitions of 29 December and the week after it run into the next year, one
    a night; a snapshot of each night lands in its own."""
    from pin_nightly import partitions as parts_mod
    from pin_nightly.db import connection, transaction

    db = catalog_db
    db.partition(D)  # the table exists
    with connection("catalog_db") as conn:
        with transaction(conn) as cur:
            assert parts_mod.ensure(cur, date(2025, 12, 29)) == 8
        with transaction(conn) as cur:
            assert parts_mod.ensure(cur, date(2025, 12, 31)) == 2  # 6 and 7 January
    days = [date(2025, 12, 29) + timedelta(days=k) for k in range(10)]
    parts = partitions(db)
    assert [parts[night_partition(d)] for d in days] == [(d, d + timedelta(days=1)) for d in days]
    cid = db.card()
    for d in days:
        db.seed_snapshot(cid, d, 1)
    assert snapshots_by_partition(db, cid) == {d: night_partition(d) for d in days}


def test_partitions_are_refused_far_in_the_future_or_many_at_once(catalog_db):
    db = catalog_db
    db.partition(D)
    today = db.one("SELECT (now() AT TIME ZONE 'UTC')::date")
    for lo, hi in (
        (D, D + timedelta(days=63)),
        (today + timedelta(days=63),) * 2,
        (D, D - timedelta(days=1)),
    ):
        with pytest.raises(psycopg.errors.InvalidParameterValue):
            db.partition(lo, hi)
    assert list(partitions(db)) == [night_partition(D)]


def test_retention_drops_exactly_the_partitions_past_the_horizon(catalog_db):
    """45 nights (some missed) of two cards: retention of D drops every partition whose nights
    are all before D - 32 and no other; a smaller window keeps them all the same; a run's date
    after the database's today is bounded by today."""
    from pin_nightly import partitions as parts_mod
    from pin_nightly.db import connection

    db = catalog_db
    cards = [db.card(views=500), db.card(views=500, kind="Project")]
    missed = {10, 33, 34}
    for age in range(1, 46):
        if age not in missed:
            for cid in cards:
                db.seed_snapshot(cid, D - timedelta(days=age), 500 - age)
    db.partition(D, D + timedelta(days=7))
    before = partitions(db)
    with connection("catalog_db") as conn:
        for keep in (0, 10, 30):  # never fewer than the nightly 30 + 2 nights kept
            dropped = []
            while (p := parts_mod.drop_oldest(conn, D, keep)) is not None:
                dropped.append(p)
            if keep == 0:
                assert [p["lower_bound"] for p in dropped] == [
                    D - timedelta(days=age) for age in range(45, HORIZON, -1) if age not in missed
                ]
                assert sum(p["snapshots"] for p in dropped) == 2 * len(dropped)
            else:
                assert dropped == []
        # a later date's horizon, bounded by the database's today: D + 1 drops D - 32 only
        p = parts_mod.drop_oldest(conn, D + timedelta(days=1), 30)
        assert p["lower_bound"] == D - timedelta(days=32)
        assert parts_mod.drop_oldest(conn, D + timedelta(days=1), 30) is None
    after = partitions(db)
    assert min(lo for lo, _ in after.values()) == D - timedelta(days=31)
    assert set(before) - set(after) == {
        night_partition(D - timedelta(days=age))
        for age in range(45, HORIZON - 1, -1)
        if age not in missed
    }
    for cid in cards:
        assert [d for d, _ in db.snapshots(cid)] == [
            D - timedelta(days=age) for age in range(31, 0, -1) if age not in missed
        ]


def test_a_dry_run_counts_what_retention_would_drop_and_drops_nothing(catalog_db):
    db = catalog_db
    cid = db.card(views=100)
    for age in range(1, 36):
        db.seed_snapshot(cid, D - timedelta(days=age), 100 - age)
    n = len(partitions(db))
    s = assert_ok(run_dag(DAG, {"dry_run": True}, logical_date=night(D)))
    assert s["dry_run_report"]["snapshots_pruned"] == 3
    assert len(db.snapshots(cid)) == 35
    assert len(partitions(db)) >= n


# --- the upgrade from the previous release's table ---------------------------------------

PREVIOUS = REPO / "tests" / "data" / "catalog_popularity_previous.sql"


def previous_release(db, nights: int = 32, cards: int = 30) -> list[str]:
    """The previous release's table with ``nights`` nights of history before D (one missed)
    for ``cards`` cards of each kind, as a deployment has it today."""
    db.q(PREVIOUS.read_text())
    ids = []
    for i in range(cards):
        for kind in ("PropertyObject", "Project"):
            cid = db.card(views=1000 + 40 * i, kind=kind)
            ids.append(cid)
            db.q(
                "INSERT INTO catalog.popularity_daily_views (card_kind, card_id, run_date, "
                "cumulative_views) SELECT %s, %s, %s::date - age, 1000 + 40 * %s - age * (%s + 1) "
                "FROM generate_series(1, %s) AS age WHERE age <> 7",
                kind,
                cid,
                D,
                i,
                i % 5,
                nights,
            )
    db.q("GRANT SELECT ON catalog.popularity_daily_views TO PUBLIC")
    assert relkind(db) == "r"
    return ids


def relkind(db) -> str:
    return db.one("SELECT relkind FROM pg_class WHERE oid = %s::regclass", TABLE)


def history(db) -> list[tuple]:
    return db.q(
        "SELECT id, card_kind, card_id, run_date, cumulative_views, created_at "
        "FROM catalog.popularity_daily_views WHERE run_date < %s ORDER BY id",
        D,
    )


class Consumer:
    """The view consumer: increments the counters of the cards (one short transaction each,
    as the platform does) and records how long each took, until stopped. Its session gives up
    on any lock it waits for longer than 20 ms (``lock_timeout``): each such wait is recorded."""

    def __init__(self, dsn: str, cards: list[str]):
        self.dsn, self.cards = dsn, cards
        self.stop = threading.Event()
        self.waits: list[float] = []
        self.lock_timeouts: list[str] = []
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def loop(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute("SET lock_timeout = '20ms'")
            i = 0
            while not self.stop.is_set():
                cid = self.cards[i % len(self.cards)]
                t = time.monotonic()
                for table in ("catalog.property_object_cards", "catalog.project_cards"):
                    try:
                        conn.execute(
                            f"UPDATE {table} SET popularity_views = popularity_views + 0 "
                            "WHERE id = %s",
                            (cid,),
                        )
                    except psycopg.errors.LockNotAvailable as exc:
                        self.lock_timeouts.append(f"{table}: {exc}")
                self.waits.append(time.monotonic() - t)
                i += 1
                time.sleep(0.002)

    def __enter__(self) -> Consumer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while len(self.waits) < 3 and time.monotonic() < deadline:  # viewing before it starts
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(10)


def card_table_locks_waited(db) -> int:
    return db.one(
        "SELECT count(*) FROM pg_locks l WHERE NOT l.granted AND l.relation IN "
        "('catalog.property_object_cards'::regclass, 'catalog.project_cards'::regclass)"
    )


def test_the_previous_release_is_upgraded_online_and_loses_no_snapshot(catalog_db):
    """32 nights of history in the previous release's table, cards being viewed: the upgrade
    the first run makes in its setup task (before its lease) never makes the view consumer wait
    20 ms for a lock; the table becomes partitioned (the old table the partition of its nights),
    every snapshot is kept as it was, and the run scores every card by the formula."""
    from pin_nightly import catalog, jobs
    from pin_nightly.db import connection

    db = catalog_db
    ids = previous_release(db)
    old = history(db)
    assert len(old) == len(ids) * 31
    with Consumer(db.dsn, ids) as consumer, connection("catalog_db") as conn:
        jobs.preflight(conn, catalog.JOB)  # what acquire_lease does first: the upgrade
    assert len(consumer.waits) >= 3 and relkind(db) == "p"
    # no lock wait of the consumer reached 20 ms (its time also counts the machine's load:
    # not asserted)
    assert consumer.lock_timeouts == []
    assert history(db) == old
    with Consumer(db.dsn, ids) as consumer:
        s = assert_ok(run_dag(DAG, {"batch_size": 7}, logical_date=night(D)))
    assert len(consumer.waits) > 20  # it went on viewing through the run
    assert s["snapshots_written"] == len(ids) and s["item_errors"] == 0
    assert relkind(db) == "p"
    assert history(db) == old  # no snapshot lost or changed
    parts = partitions(db)
    today = db.one("SELECT (now() AT TIME ZONE 'UTC')::date")
    assert parts["catalog.popularity_daily_views_legacy"] == (
        D - timedelta(days=32),
        today + timedelta(days=1),
    )
    # tonight (D is long past) was written into the old table's range
    assert db.one(
        "SELECT count(*) FROM catalog.popularity_daily_views_legacy WHERE run_date = %s", D
    ) == len(ids)
    for cid in ids:
        kind = db.one(
            "SELECT card_kind FROM catalog.popularity_daily_views WHERE card_id = %s LIMIT 1", cid
        )
        assert db.score(cid, kind) == reference_score(dict(db.snapshots(cid)), D, 30, 7)
    # the spec's index names, as partitioned indexes over every partition
    idx = dict(
        db.q(
            "SELECT c.relname, c.relkind FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE i.indrelid = 'catalog.popularity_daily_views'::regclass"
        )
    )
    assert idx == {
        "ix_popularity_daily_unique": "I",
        "ix_popularity_daily_window": "I",
        "ix_popularity_daily_run_date": "I",
        "popularity_daily_views_pkey": "I",
    }
    # the grants the old table had, on the new one
    assert db.one(
        "SELECT has_table_privilege('public', 'catalog.popularity_daily_views', 'SELECT')"
    )
    # a re-run of the date: the same scores, nothing new
    s = assert_ok(run_dag(DAG, {"batch_size": 7}, logical_date=night(D)))
    assert s["property_object_cards_updated"] + s["project_cards_updated"] == 0


def test_an_upgrade_interrupted_before_its_swap_is_finished_by_the_next_run(catalog_db):
    """The concurrent steps of an upgrade done (and one left an invalid index), the swap never
    made: the next run goes on from there and loses nothing."""
    from pin_nightly.db import sql

    db = catalog_db
    ids = previous_release(db, nights=32, cards=5)
    old = history(db)
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        conn.execute(sql("catalog/migrate_run_date"))
        conn.execute(
            "CREATE UNIQUE INDEX CONCURRENTLY popularity_daily_views_legacy_id_run_date "
            "ON catalog.popularity_daily_views (id, run_date)"
        )
        conn.execute(  # as a build interrupted half-way leaves it
            "UPDATE pg_index SET indisvalid = false WHERE indexrelid = "
            "'catalog.popularity_daily_views_legacy_id_run_date'::regclass"
        )
        today = conn.execute("SELECT (now() AT TIME ZONE 'UTC')::date").fetchone()[0]
        conn.execute(
            "ALTER TABLE catalog.popularity_daily_views ADD CONSTRAINT "
            "popularity_daily_views_legacy_range CHECK (run_date >= "
            f"'{D - timedelta(days=40)}'::date AND run_date < '{today + timedelta(days=1)}'::date) "
            "NOT VALID"
        )
    assert_ok(run_dag(DAG, {}, logical_date=night(D)))
    assert history(db) == old
    assert partitions(db)["catalog.popularity_daily_views_legacy"] == (
        D - timedelta(days=40),
        today + timedelta(days=1),
    )
    for cid in ids:
        assert len(db.snapshots(cid)) == 32


def test_retention_drops_a_range_partition_only_when_all_its_nights_are_past_the_horizon(
    catalog_db,
):
    """The upgraded table is one partition of many nights: retention drops it whole on the
    first night whose horizon is past its newest night, never before."""
    from pin_nightly import partitions as parts_mod
    from pin_nightly.db import connection

    db = catalog_db
    cid = db.card(views=100)
    db.seed_snapshot(cid, D - timedelta(days=19), 81)  # creates the table and that night's
    db.q(
        "CREATE TABLE catalog.popularity_daily_views_legacy (LIKE catalog.popularity_daily_views "
        "INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"
    )
    db.q(
        "ALTER TABLE catalog.popularity_daily_views ATTACH PARTITION "
        f"catalog.popularity_daily_views_legacy FOR VALUES FROM ('{D - timedelta(days=40)}') "
        f"TO ('{D - timedelta(days=20)}')"
    )
    for age in range(40, 20, -1):
        db.seed_snapshot(cid, D - timedelta(days=age), 100 - age)
    with connection("catalog_db") as conn:
        # its newest night is D - 21: a run of D + 11 still reads it (D + 11 - 32 = D - 21)
        assert parts_mod.drop_oldest(conn, D + timedelta(days=11), 30) is None
        p = parts_mod.drop_oldest(conn, D + timedelta(days=12), 30)
        assert p["partition"] == "catalog.popularity_daily_views_legacy"
        assert p["snapshots"] == 20
        assert parts_mod.drop_oldest(conn, D + timedelta(days=12), 30) is None
    assert [d for d, _ in db.snapshots(cid)] == [D - timedelta(days=19)]


def test_a_role_that_may_not_upgrade_gets_the_dba_step_and_nothing_is_written(
    catalog_db, monkeypatch, capfd, caplog
):
    from psycopg.conninfo import make_conninfo

    from tests.test_security import _drop_role, _login_role
    from tools.devenv import airflow_connection, run_sql_file

    db = catalog_db
    ids = previous_release(db, nights=5, cards=2)
    run_sql_file(db.dsn, "schema/pin_nightly.sql")
    run_sql_file(db.dsn, "schema/roles.sql")
    old = history(db)
    login = _login_role("pin_catalog_job")
    try:
        monkeypatch.setenv(
            "AIRFLOW_CONN_CATALOG_DB", airflow_connection(make_conninfo(db.dsn, user=login))
        )
        r = run_dag(DAG, {}, logical_date=night(D))
        assert r["state"] == "failed"
        text = capfd.readouterr().out + caplog.text
        assert "has the previous release's layout" in text
        assert "python -m pin_nightly.partitions" in text
        assert history(db) == old
        assert (
            db.one("SELECT count(*) FROM catalog.popularity_daily_views WHERE run_date = %s", D)
            == 0
        )
        assert relkind(db) == "r"
        assert all(db.score(c, k) == 0 for c, k in zip(ids, ["PropertyObject", "Project"] * 2))
    finally:
        _drop_role(login)
