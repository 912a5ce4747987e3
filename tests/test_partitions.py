"""The snapshot table's partitions (one a night): created ahead across month and year ends,
dropped by retention exactly past the horizon, and the online upgrade of the previous
release's table. Real Airflow (dag.test) on a real PostgreSQL."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from datetime import date, timedelta

import psycopg
import pytest

from tests.helpers import assert_ok, night, wait_for
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
    partition, created by the run (and a week ahead), and every score is the formula's. Each
    night runs on the job's clock set to its date."""
    db = catalog_db
    cid = db.card(views=10)
    db.seed_snapshot(cid, date(2026, 1, 30), 4)
    views, nights = 10, (date(2026, 1, 31), date(2026, 2, 1), date(2026, 2, 3))
    for d in nights + (date(2026, 2, 28), date(2026, 3, 1)):
        views += 7
        db.set_views(cid, views)
        db.set_today(d)
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
    db.set_today(D)
    s = assert_ok(run_dag(DAG, {"dry_run": True}, logical_date=night(D)))
    assert s["dry_run_report"]["snapshots_pruned"] == 3
    assert len(db.snapshots(cid)) == 35
    assert len(partitions(db)) >= n


# --- the upgrade from the previous release's table ---------------------------------------

PREVIOUS = REPO / "tests" / "data" / "catalog_popularity_previous.sql"
LEGACY = "catalog.popularity_daily_views_legacy"


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


def bulk_history(db, cards: int, nights: int) -> None:
    """``cards`` x ``nights`` more snapshots before D in the previous release's table (of cards
    the catalog no longer lists), loaded as a restore loads them: the rows, then the indexes."""
    db.q("ALTER TABLE catalog.popularity_daily_views DROP CONSTRAINT popularity_daily_views_pkey")
    db.q(
        "DROP INDEX catalog.ix_popularity_daily_unique, catalog.ix_popularity_daily_window, "
        "catalog.ix_popularity_daily_run_date"
    )
    db.q(
        "INSERT INTO catalog.popularity_daily_views (card_kind, card_id, run_date, "
        "cumulative_views) SELECT 'Project', "
        "('00000000-0000-4000-8000-' || lpad(to_hex(c), 12, '0'))::uuid, %s::date - n, n "
        "FROM generate_series(1, %s) AS c, generate_series(1, %s) AS n",
        D,
        cards,
        nights,
    )
    db.q("ALTER TABLE catalog.popularity_daily_views ADD PRIMARY KEY (id)")
    db.q(PREVIOUS.read_text())
    db.q("VACUUM ANALYZE catalog.popularity_daily_views")


def previous_release_night(db, d: date) -> None:
    """A night ``d`` of the previous release (rolled back to), as it writes it: a snapshot of
    every card, upserted on the unique key, then its retention's delete past its horizon."""
    for kind, table in db.TABLES.items():
        db.q(
            "INSERT INTO catalog.popularity_daily_views (card_kind, card_id, run_date, "
            f"cumulative_views) SELECT %s, id, %s, popularity_views FROM {table} "
            "ON CONFLICT (card_kind, card_id, run_date) "
            "DO UPDATE SET cumulative_views = excluded.cumulative_views",
            kind,
            d,
        )
    db.q("DELETE FROM catalog.popularity_daily_views WHERE run_date < %s::date - 32", d)


def relkind(db) -> str:
    return db.one("SELECT relkind FROM pg_class WHERE oid = %s::regclass", TABLE)


def history(db) -> list[tuple]:
    return db.q(
        "SELECT id, card_kind, card_id, run_date, cumulative_views, created_at "
        "FROM catalog.popularity_daily_views WHERE run_date < %s ORDER BY id",
        D,
    )


def digest(db) -> tuple:
    """Every snapshot, in one value: how many, and a hash of them all."""
    return db.q(
        "SELECT count(*), md5(string_agg(concat_ws(' ', id, card_kind, card_id, run_date, "
        "cumulative_views, created_at), ',' ORDER BY id)) FROM catalog.popularity_daily_views"
    )[0]


def night_count(db, d: date) -> int:
    return db.one("SELECT count(*) FROM catalog.popularity_daily_views WHERE run_date = %s", d)


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


def test_the_previous_release_is_upgraded_online_and_loses_no_snapshot(catalog_db):
    """32 nights of history in the previous release's table, cards being viewed: the night's
    run writes to the old table (the upgrade is not the job's); the DBA's command then upgrades
    it while the cards are viewed and never makes the view consumer wait 20 ms for a lock; the
    table becomes partitioned (the old table the partition of its nights, up to the week after
    the job's clock), every snapshot is kept as it was, and the next night scores every card by
    the formula."""
    from pin_nightly import partitions as parts_mod

    db = catalog_db
    db.set_today(D)
    ids = previous_release(db)
    old = history(db)
    assert len(old) == len(ids) * 31
    s = assert_ok(run_dag(DAG, {"batch_size": 7}, logical_date=night(D)))
    assert s["snapshots_written"] == len(ids) and s["item_errors"] == 0
    assert relkind(db) == "r" and night_count(db, D) == len(ids)
    tonight = db.q(
        "SELECT * FROM catalog.popularity_daily_views WHERE run_date = %s ORDER BY id", D
    )
    with Consumer(db.dsn, ids) as consumer:
        assert parts_mod.upgrade(db.dsn) == {
            "lower_bound": D - timedelta(days=32),
            "upper_bound": D + timedelta(days=8),
        }
    assert len(consumer.waits) >= 3 and relkind(db) == "p"
    # no lock wait of the consumer reached 20 ms (its time also counts the machine's load:
    # not asserted)
    assert consumer.lock_timeouts == []
    assert history(db) == old  # no snapshot lost or changed
    assert (
        db.q(
            "SELECT * FROM catalog.popularity_daily_views_legacy WHERE run_date = %s ORDER BY id", D
        )
        == tonight
    )
    assert partitions(db) == {LEGACY: (D - timedelta(days=32), D + timedelta(days=8))}
    d1 = D + timedelta(days=1)
    db.set_today(d1)
    with Consumer(db.dsn, ids) as consumer:
        s = assert_ok(run_dag(DAG, {"batch_size": 7}, logical_date=night(d1)))
    assert len(consumer.waits) > 20  # it went on viewing through the run
    assert s["snapshots_written"] == len(ids) and s["item_errors"] == 0
    for cid in ids:
        kind = db.one(
            "SELECT card_kind FROM catalog.popularity_daily_views WHERE card_id = %s LIMIT 1", cid
        )
        assert db.score(cid, kind) == reference_score(dict(db.snapshots(cid)), d1, 30, 7)
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
    # a re-run of the date: the same scores, nothing new; the command again: nothing to do
    s = assert_ok(run_dag(DAG, {"batch_size": 7}, logical_date=night(d1)))
    assert s["property_object_cards_updated"] + s["project_cards_updated"] == 0
    assert parts_mod.upgrade(db.dsn) is None


def test_nights_go_on_under_a_statement_timeout_and_the_dba_command_upgrades(catalog_db):
    """600,000 snapshots in the previous release's table and a statement_timeout of 200 ms on
    its database, which every session of the job and of the DBA gets: an index built
    concurrently over them takes longer. Two nights each write their 20 snapshots to the old
    table (the upgrade is not the job's: under that bound it would be cancelled every night,
    its index dropped and built again from nothing); the DBA's command, under the same
    setting, builds and validates without a statement_timeout, says how far it got, and loses
    nothing; the next night is written to the partitioned table."""
    db = catalog_db
    ids = previous_release(db, nights=3, cards=10)
    bulk_history(db, cards=20_000, nights=30)
    db.q(f"ALTER DATABASE \"{db.conn.info.dbname}\" SET statement_timeout = '200ms'")
    for d in (D, D + timedelta(days=1)):
        db.set_today(d)
        s = assert_ok(run_dag(DAG, {}, logical_date=night(d)))
        assert s["snapshots_written"] == len(ids) and night_count(db, d) == len(ids)
    assert relkind(db) == "r"
    before = digest(db)
    out = subprocess.run(
        [sys.executable, "-m", "pin_nightly.partitions", db.dsn, "--progress-seconds", "0.05"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO / "plugins")},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert relkind(db) == "p" and digest(db) == before
    key = "upgrade: building the index of the key (id, run_date) concurrently: "
    assert re.search(
        re.escape(key) + r"\d+ s, (building index|waiting|index validation)", out.stdout
    )
    assert key + "done in" in out.stdout
    assert "upgrade: validating the range check (a full scan): done in" in out.stdout
    d2 = D + timedelta(days=2)
    db.set_today(d2)
    s = assert_ok(run_dag(DAG, {}, logical_date=night(d2)))
    assert s["snapshots_written"] == len(ids) and night_count(db, d2) == len(ids)


def interrupt_the_key_build(db) -> None:
    """The DBA's command, its index build waiting for a batch in flight (a transaction that
    writes the table), loses its connection (its server process ends): the index is left
    invalid and nothing else is done."""
    from pin_nightly import partitions as parts_mod

    lost = []

    def command() -> None:
        try:
            parts_mod.upgrade(db.dsn)
        except psycopg.OperationalError as exc:
            lost.append(exc)

    with psycopg.connect(db.dsn) as batch:
        batch.execute("LOCK TABLE catalog.popularity_daily_views IN ROW EXCLUSIVE MODE")
        thread = threading.Thread(target=command)
        thread.start()
        pid = wait_for(
            lambda: db.one(
                "SELECT max(pid) FROM pg_stat_progress_create_index WHERE relid = %s::regclass "
                "AND phase LIKE 'waiting for writers%%'",
                TABLE,
            ),
            what="the index build waiting for the batch",
        )
        db.q("SELECT pg_terminate_backend(%s)", pid)
        thread.join(30)
        batch.rollback()
    assert lost


def upgrade_until(db, step: str) -> None:
    """What an upgrade interrupted at ``step`` leaves: its index build's connection lost, or
    the command's own statements up to that step (each later step is one transaction or one
    statement: interrupted, it leaves what the steps before it did)."""
    from pin_nightly import partitions as parts_mod
    from pin_nightly.db import sql

    if step == "building the key":
        return interrupt_the_key_build(db)
    if step == "done":
        return parts_mod.upgrade(db.dsn)
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        conn.execute(sql("catalog/migrate_key"))
        if step == "adding the range check":
            return None
        with conn.transaction():
            conn.execute(sql("catalog/migrate_room"), {"nights": str(parts_mod.AHEAD_DAYS)})
            conn.execute(sql("catalog/migrate_range_check"))
        if step == "swapping":
            conn.execute(sql("catalog/migrate_validate"))
    return None


UPGRADE_STATES = {
    "building the key": "key index left invalid by an interrupted build, range check not added",
    "adding the range check": "key index built, range check not added",
    "validating the range check": (
        "key index built, range check added, not validated (nights 2026-07-30 to 2026-09-07)"
    ),
    "swapping": "key index built, range check validated (nights 2026-07-30 to 2026-09-07)",
}


@pytest.mark.parametrize("step", [*UPGRADE_STATES, "done"])
def test_an_upgrade_interrupted_at_any_step_leaves_the_previous_release_working(catalog_db, step):
    """An upgrade interrupted at ``step`` (or done): this release's night is written; the
    previous release, rolled back to, writes its next three nights after the job's clock and
    prunes as it did; the DBA's command, run again, goes on from there, finishes and loses
    nothing; and this release's next night is written."""
    from pin_nightly import partitions as parts_mod

    db = catalog_db
    db.set_today(D)
    ids = previous_release(db, nights=32, cards=3)
    upgrade_until(db, step)
    if step in UPGRADE_STATES:
        with psycopg.connect(db.dsn) as conn:
            assert parts_mod.describe(parts_mod.upgrade_state(conn)) == UPGRADE_STATES[step]
    assert relkind(db) == ("p" if step == "done" else "r")
    s = assert_ok(run_dag(DAG, {}, logical_date=night(D)))
    assert s["snapshots_written"] == len(ids) and night_count(db, D) == len(ids)
    for k in (1, 2, 3):  # the previous release's next nights, and its retention
        previous_release_night(db, D + timedelta(days=k))
        assert night_count(db, D + timedelta(days=k)) == len(ids)
    before = digest(db)
    parts_mod.upgrade(db.dsn)
    assert relkind(db) == "p" and digest(db) == before
    # the range check's nights: those of the old table when it was added, and the week after
    # the newer of its newest night and the job's clock (D + 3 once the rollback's nights ran)
    added_before = step in ("validating the range check", "swapping", "done")
    lo, hi = (
        (D - timedelta(days=32), D)
        if added_before
        else (D - timedelta(days=29), D + timedelta(days=3))
    )
    assert partitions(db)[LEGACY] == (lo, hi + timedelta(days=8))
    d4 = D + timedelta(days=4)
    db.set_today(d4)
    s = assert_ok(run_dag(DAG, {}, logical_date=night(d4)))
    assert s["snapshots_written"] == len(ids) and night_count(db, d4) == len(ids)


@pytest.mark.parametrize("way_out", ["the upgrade goes on", "the check is dropped"])
def test_an_upgrade_left_interrupted_past_its_week_is_named_then_either_way_out_works(
    catalog_db, capfd, caplog, way_out
):
    """An upgrade interrupted while it validated its range check on night D (which admits the
    nights up to D + 7): the run of D + 8 writes nothing and names the DBA's two ways out.
    Either works: the command goes on (validates, swaps, makes tonight's partition and the week
    after it), or the runbook drops the check; then the night is written, and so is a night of
    the previous release (rolled back to) after it."""
    from pin_nightly import partitions as parts_mod

    db = catalog_db
    db.set_today(D)
    ids = previous_release(db, nights=5, cards=2)
    upgrade_until(db, "validating the range check")
    late = D + timedelta(days=8)
    db.set_today(late)
    r = run_dag(DAG, {}, logical_date=night(late))
    assert r["state"] == "failed"
    text = capfd.readouterr().out + caplog.text
    assert "admits no night after 2026-09-07; nothing was written" in text
    assert "python -m pin_nightly.partitions" in text and "drops the check" in text
    assert night_count(db, late) == 0 and relkind(db) == "r"
    if way_out == "the upgrade goes on":
        parts_mod.upgrade(db.dsn)
        parts = partitions(db)
        assert parts[LEGACY] == (D - timedelta(days=5), late)
        made = [night_partition(late + timedelta(days=k)) in parts for k in range(9)]
        assert made == [True] * 8 + [False]
    else:  # the runbook's statement
        db.q(
            "ALTER TABLE catalog.popularity_daily_views "
            "DROP CONSTRAINT IF EXISTS popularity_daily_views_legacy_range"
        )
    assert_ok(run_dag(DAG, {}, logical_date=night(late)))
    assert night_count(db, late) == len(ids)
    if way_out == "the upgrade goes on":
        assert snapshots_by_partition(db, ids[0])[late] == night_partition(late)
    previous_release_night(db, late + timedelta(days=1))
    assert night_count(db, late + timedelta(days=1)) == len(ids)


def test_a_least_privilege_role_writes_its_nights_on_the_previous_layout(
    catalog_db, monkeypatch, capfd, caplog
):
    """The least-privilege pin_catalog_job, which may not upgrade the previous release's table:
    its run writes the night into it, retention deletes the snapshots past the horizon in
    batches of ``batch_size`` (what a dry run counts), the log names the DBA's step, and the
    table keeps its layout."""
    from psycopg.conninfo import make_conninfo

    from pin_nightly import partitions as parts_mod
    from pin_nightly.db import connection, transaction
    from tests.test_security import _drop_role, _login_role
    from tools.devenv import airflow_connection, run_sql_file

    db = catalog_db
    db.set_today(D)
    ids = previous_release(db, nights=40, cards=2)
    run_sql_file(db.dsn, "schema/pin_nightly.sql")
    run_sql_file(db.dsn, "schema/roles.sql")
    kept = [row for row in history(db) if row[3] >= D - timedelta(days=32)]
    login = _login_role("pin_catalog_job")
    try:
        monkeypatch.setenv(
            "AIRFLOW_CONN_CATALOG_DB", airflow_connection(make_conninfo(db.dsn, user=login))
        )
        with connection("catalog_db") as conn, transaction(conn) as cur:
            assert parts_mod.would_prune(cur, D, 30) == 8 * len(ids)  # nights D - 40 .. D - 33
        s = assert_ok(run_dag(DAG, {"batch_size": 3}, logical_date=night(D)))
        text = capfd.readouterr().out + caplog.text
        assert "has the previous release's layout (one table)" in text
        assert "python -m pin_nightly.partitions" in text
        assert s["snapshots_written"] == len(ids) and s["snapshots_pruned"] == 8 * len(ids)
        assert relkind(db) == "r" and history(db) == kept and night_count(db, D) == len(ids)
        for cid, kind in zip(ids, ["PropertyObject", "Project"] * 2):
            assert db.score(cid, kind) == reference_score(dict(db.snapshots(cid)), D, 30, 7)
    finally:
        _drop_role(login)


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
