"""Test helpers: data builders and readers over a real PostgreSQL."""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import random
import threading
import time
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from unittest import mock

import psycopg
import pytest

from pin_nightly.db import sql
from tools import devenv
from tools.datagen import uuid7
from tools.proc import wait_until

_rnd = random.Random(1234)
_clock = [datetime(2026, 1, 1, tzinfo=UTC)]


def new_id(at: datetime | None = None) -> str:
    """A fresh uuid v7, increasing across calls (keyset order = creation order)."""
    if at is None:
        _clock[0] += timedelta(milliseconds=1)
        at = _clock[0]
    return str(uuid7(at, _rnd))


def set_clock(d: date | None, dbname: str | None = None) -> None:
    """Run the nights that follow "as of" ``d`` on a job's test database (the catalog test
    database unless ``dbname``), the documented way (docs/development.md): its
    ``pin_nightly.today``, read by every session opened after it; None: the real date again."""
    if dbname is None:
        dbname = json.loads(os.environ["AIRFLOW_CONN_CATALOG_DB"])["schema"]
    with psycopg.connect(devenv.dsn_for(dbname), autocommit=True) as conn:
        if d is None:
            conn.execute(f'ALTER DATABASE "{dbname}" RESET pin_nightly.today')
        else:
            conn.execute(f"ALTER DATABASE \"{dbname}\" SET pin_nightly.today = '{d.isoformat()}'")


def run_night(dag_id: str, conf: dict | None, d: date, **kw: Any) -> dict[str, Any]:
    """The scheduled run of night ``d`` (03:00 UTC), "as of" ``d``: the job's clock set to it."""
    from tools.rundag import run_dag

    set_clock(d, json.loads(os.environ[_CONN_ENV[dag_id]])["schema"])
    return run_dag(dag_id, conf, logical_date=night(d), **kw)


_CONN_ENV = {
    "catalog_popularity_recompute": "AIRFLOW_CONN_CATALOG_DB",
    "news_comment_reconcile": "AIRFLOW_CONN_NEWS_DB",
}


def night(d: date) -> datetime:
    """The logical date of the scheduled run of day ``d`` at 03:00 UTC (the popularity job's
    slot; its as_of_date is ``d``)."""
    return datetime(d.year, d.month, d.day, 3, 0, tzinfo=UTC)


def assert_ok(r: dict[str, Any]) -> dict[str, Any]:
    """The summary of a run (a :func:`tools.rundag.run_dag` outcome) that must have succeeded."""
    assert r["state"] == "success", r["tasks"]
    return r["summary"]


def failed_tasks(r: dict[str, Any]) -> list:
    """The failed and upstream-failed task instances of a run outcome, as ``clear_and_resume``
    takes them (``(task_id, map_index)`` for a mapped one)."""
    return [
        (k.split("[")[0], int(k.split("[")[1][:-1])) if "[" in k else k
        for k, v in r["tasks"].items()
        if v in ("failed", "upstream_failed")
    ]


class InjectedFault(RuntimeError):
    """A failure the tests inject into a task (see :func:`inject`)."""


def inject(monkeypatch, target: str, how: str, kind: str | None = None) -> dict:
    """Make ``module.function`` fail once; returns a record of whether it fired. ``dag.test()``
    runs the tasks in this process, so the wrapper is what the task calls: ``before`` raises
    instead of calling it, ``after`` raises once it has done its work (the task dies between its
    last write and its return), ``mid_batch`` (``target`` a make_batch, of card kind ``kind``
    if given) raises inside the second batch's transaction (the second call of the job's
    ``batch``), as a worker lost mid-batch."""
    module_name, attr = target.rsplit(".", 1)
    module = importlib.import_module(module_name)
    real = getattr(module, attr)
    state = {"fired": False}

    if how == "mid_batch":  # target is a make_batch

        @functools.wraps(real)
        def make_batch(*args, **kwargs):
            job = real(*args, **kwargs)
            if kind is not None and kind not in args:
                return job
            calls = [0]
            batch = job.batch

            def failing(cur, *a):
                out = batch(cur, *a)
                calls[0] += 1
                if calls[0] == 2 and not state["fired"]:
                    state["fired"] = True
                    raise InjectedFault(f"{target}: worker lost in the middle of a batch")
                return out

            job.batch = failing
            return job

        monkeypatch.setattr(module, attr, make_batch)
        return state

    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        if state["fired"]:
            return real(*args, **kwargs)
        state["fired"] = True
        if how == "before":
            raise InjectedFault(f"{target}: failed before doing anything")
        real(*args, **kwargs)
        raise InjectedFault(f"{target}: failed after its work, before returning")

    monkeypatch.setattr(module, attr, wrapper)
    return state


@contextlib.contextmanager
def after_each_batch(fn):
    """Call ``fn(batch)`` after each batch of a range that read rows, once its transaction has
    committed (as a concurrent session would act between two batches)."""
    from pin_nightly import ranges

    real = ranges._Range.batch

    def batch(self, *args, **kwargs):
        b, renew_due = real(self, *args, **kwargs)
        if b is not None and b.last_id is not None:
            fn(b)
        return b, renew_due

    with mock.patch.object(ranges._Range, "batch", batch):
        yield


def budget_spent_after_each_batch(db):
    """The run's budget ends as each batch commits (its deadline moved to now, as the runbook's
    graceful stop does): whatever the machine's speed, a run does one batch a range."""
    spend = "UPDATE pin_nightly.job_lease SET run_deadline_at = clock_timestamp()"
    return after_each_batch(lambda _b: db.q(spend))


class NewsDB:
    def __init__(self, dsn: str, conn: psycopg.Connection):
        self.dsn = dsn
        self.conn = conn

    def fail_updates_of(
        self, row_id: str, table: str = "news.posts", errcode: str = "disk_full"
    ) -> None:
        """Every UPDATE of this row of ``table`` raises: by default an infrastructure failure
        (SQLSTATE disk_full: the batch and its task fail); with errcode ``raise_exception``, a
        domain trigger that rejects the row (the job isolates it). See allow_updates."""
        message = "disk full (simulated)" if errcode == "disk_full" else "rejected (simulated)"
        self.q(
            "CREATE OR REPLACE FUNCTION public.fail_one() RETURNS trigger LANGUAGE plpgsql AS $$ "
            f"BEGIN IF NEW.id = '{row_id}' THEN RAISE EXCEPTION '{message}' "
            f"USING ERRCODE = '{errcode}'; END IF; RETURN NEW; END $$"
        )
        self.q(
            f"CREATE TRIGGER fail_one BEFORE UPDATE ON {table} FOR EACH ROW "
            "EXECUTE FUNCTION public.fail_one()"
        )

    def allow_updates(self, table: str = "news.posts") -> None:
        self.q(f"DROP TRIGGER IF EXISTS fail_one ON {table}")
        self.q(f"DROP TRIGGER IF EXISTS reject_all ON {table}")
        self.q(f"DROP TRIGGER IF EXISTS slow ON {table}")
        self.q(f"DROP TRIGGER IF EXISTS held ON {table}")

    def hold_updates_from(self, row_id: str, table: str = "news.posts") -> None:
        """Every UPDATE of a row of ``table`` from ``row_id`` on waits, inside its batch, until
        :meth:`release_updates` (a flag polled every 0.2 s: no lock, so no lock_timeout, and
        the flag's UPDATE waits for nothing the batch holds); see allow_updates."""
        self.q("CREATE TABLE IF NOT EXISTS public.held (released boolean NOT NULL)")
        self.q("TRUNCATE public.held")
        self.q("INSERT INTO public.held VALUES (false)")
        self.q(
            "CREATE OR REPLACE FUNCTION public.held() RETURNS trigger LANGUAGE plpgsql AS $$ "
            f"BEGIN IF NEW.id >= '{row_id}' THEN LOOP EXIT WHEN (SELECT released FROM "
            "public.held); PERFORM pg_sleep(0.2); END LOOP; END IF; RETURN NEW; END $$"
        )
        self.q(f"CREATE TRIGGER held BEFORE UPDATE ON {table} FOR EACH ROW EXECUTE FUNCTION held()")

    def release_updates(self) -> None:
        self.q("UPDATE public.held SET released = true")

    def slow_updates(self, seconds: float, table: str = "news.posts") -> None:
        """Every UPDATE of ``table`` takes ``seconds`` more (a trigger; see allow_updates)."""
        self.q(
            "CREATE OR REPLACE FUNCTION public.slow() RETURNS trigger LANGUAGE plpgsql AS "
            f"$$ BEGIN PERFORM pg_sleep({float(seconds)}); RETURN NEW; END $$"
        )
        self.q(f"CREATE TRIGGER slow BEFORE UPDATE ON {table} FOR EACH ROW EXECUTE FUNCTION slow()")

    def reject_all_updates(self, table: str, errcode: str = "check_violation") -> None:
        """A CHECK-like trigger rejects every UPDATE of ``table`` (by default SQLSTATE
        check_violation); see allow_updates."""
        self.q(
            "CREATE OR REPLACE FUNCTION public.reject_all() RETURNS trigger LANGUAGE plpgsql AS "
            f"$$ BEGIN RAISE EXCEPTION 'frozen (simulated)' USING ERRCODE = '{errcode}'; "
            "END $$"
        )
        self.q(
            f"CREATE TRIGGER reject_all BEFORE UPDATE ON {table} FOR EACH ROW "
            "EXECUTE FUNCTION public.reject_all()"
        )

    def rows_per_range(self, sweep_id: int) -> list[int]:
        """Rows each range of the sweep processed, in range order (all attempts together)."""
        rows = self.q(
            "SELECT rows_processed FROM pin_nightly.sweep_range WHERE sweep_id = %s "
            "ORDER BY range_no",
            sweep_id,
        )
        return [n for (n,) in rows]

    def q(self, sql: str, *params: Any) -> list[tuple]:
        cur = self.conn.execute(sql, params or None)
        return cur.fetchall() if cur.description else []

    def one(self, sql: str, *params: Any) -> Any:
        return self.q(sql, *params)[0][0]

    def post(
        self,
        count: int = 0,
        visible: int = 0,
        hidden: int = 0,
        deleted: int = 0,
        status: str = "Published",
        comments_at: datetime | None = None,
        updated_at: datetime | None = None,
    ) -> str:
        pid = new_id()
        self.conn.execute(
            "INSERT INTO news.posts (id, status, comments_count, updated_at) "
            "VALUES (%s, %s, %s, %s)",
            (pid, status, count, updated_at or datetime(2026, 1, 1, tzinfo=UTC)),
        )
        at = comments_at or datetime.now(UTC) - timedelta(days=10)
        for st, n in (
            ("Visible", visible),
            ("HiddenByModerator", hidden),
            ("DeletedByAuthor", deleted),
        ):
            for _ in range(n):
                self.conn.execute(
                    "INSERT INTO news.comments (id, post_id, status, created_at, updated_at) "
                    "VALUES (%s, %s, %s, %s, %s)",
                    (new_id(), pid, st, at, at),
                )
        return pid

    def posts(self, n: int, drift_every: int = 0, visible: int = 2) -> list[str]:
        """n posts with ``visible`` visible comments each; every drift_every-th one drifted."""
        ids = []
        for i in range(n):
            drifted = drift_every and i % drift_every == 0
            ids.append(self.post(count=visible + (3 if drifted else 0), visible=visible))
        return ids

    def count(self, pid: str) -> int:
        return self.one("SELECT comments_count FROM news.posts WHERE id = %s", pid)

    def post_row(self, pid: str) -> tuple:
        return self.q(
            "SELECT id, status, comments_count, updated_at FROM news.posts WHERE id = %s", pid
        )[0]

    def drifted_posts(self) -> int:
        return self.one(
            "SELECT count(*) FROM news.posts p WHERE p.status IS DISTINCT FROM 'Archived' AND "
            "p.comments_count <> (SELECT count(*) FROM news.comments c "
            "WHERE c.post_id = p.id AND c.status = 'Visible')"
        )

    def today(self):
        """The job's clock (include/sql/common/today.sql): the database's current date in UTC,
        or the date :meth:`set_today` set."""
        return self.one(sql("common/clock"))

    def set_today(self, d: date | None) -> None:
        """Run the nights that follow "as of" ``d`` (None: the real date again): the job's
        clock of this database (:func:`set_clock`), and of this helper's own session."""
        set_clock(d, self.conn.info.dbname)
        if d is None:
            self.q("RESET pin_nightly.today")
        else:
            self.q("SELECT set_config('pin_nightly.today', %s, false)", d.isoformat())

    def snapshot(self) -> list[tuple]:
        return self.q("SELECT id, status, comments_count, updated_at FROM news.posts ORDER BY id")


def when(
    condition: Callable[[], bool],
    action: Callable[[], None],
    timeout: float = 60,
    poll: float = 0.01,
) -> threading.Thread:
    """In a background thread: once ``condition()`` holds, run ``action()``."""

    def loop():
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if condition():
                    action()
                    return
            except Exception:  # noqa: BLE001 - the tables may not exist yet
                pass
            time.sleep(poll)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


class CatalogDB(NewsDB):
    TABLES = {"PropertyObject": "catalog.property_object_cards", "Project": "catalog.project_cards"}

    def card(
        self,
        views: int | None = 0,
        kind: str = "PropertyObject",
        status: str = "Published",
        score: float = 0,
    ) -> str:
        cid = new_id()
        self.conn.execute(
            f"INSERT INTO {self.TABLES[kind]} (id, status, popularity_views, popularity_score, "
            "updated_at) VALUES (%s, %s, %s, %s, '2026-01-01')",
            (cid, status, views, score),
        )
        return cid

    def set_views(self, cid: str, views: int | None, kind: str = "PropertyObject") -> None:
        self.conn.execute(
            f"UPDATE {self.TABLES[kind]} SET popularity_views = %s WHERE id = %s", (views, cid)
        )

    def score(self, cid: str, kind: str = "PropertyObject"):
        return self.one(f"SELECT popularity_score FROM {self.TABLES[kind]} WHERE id = %s", cid)

    def snapshots(self, cid: str) -> list[tuple]:
        return self.q(
            "SELECT run_date, cumulative_views FROM catalog.popularity_daily_views "
            "WHERE card_id = %s ORDER BY run_date",
            cid,
        )

    def partition(self, run_date, through=None) -> None:
        """The snapshot table's partitions of ``run_date`` .. ``through`` (as the job creates
        them ahead of its nights)."""
        from tools.devenv import run_sql_file

        if not self.one("SELECT to_regclass('catalog.popularity_daily_views') IS NOT NULL"):
            run_sql_file(self.dsn, "schema/catalog_popularity.sql")
        self.conn.execute(
            "SELECT catalog.popularity_ensure_partitions(%s::date, %s::date)",
            (run_date, through or run_date),
        )

    def cards_seen_the_night_before(
        self, d, n: int, views: int = 20, seen: int = 10, kind: str = "PropertyObject"
    ) -> list[str]:
        """``n`` cards of ``kind`` with counters ``views``, ``views + 1``, ... and a snapshot
        of ``seen`` views on the night before ``d``: each has a delta to score on night d."""
        cards = [self.card(views=views + i, kind=kind) for i in range(n)]
        for c in cards:
            self.seed_snapshot(c, d - timedelta(days=1), seen, kind)
        return cards

    def seed_snapshot(self, cid: str, run_date, views: int, kind: str = "PropertyObject"):
        self.partition(run_date)
        self.conn.execute(
            "INSERT INTO catalog.popularity_daily_views (card_kind, card_id, run_date, "
            "cumulative_views) VALUES (%s, %s, %s, %s)",
            (kind, cid, run_date, views),
        )


def news_full_sweep_range(conn, lease, run_id: str, batch_size: int, limits=None):
    """A FullSweep of the news job opened for ``run_id`` as one range over every post, and the
    batch worker that works it (what ``runs.plan`` and a range task build), with ``limits``
    over the params' defaults."""
    from pin_nightly import news, sweeps
    from pin_nightly.db import sql

    spec = sweeps.SweepSpec(job=news.JOB.code, family="FullSweep")
    source = sql("news/full_source").strip()
    sweep = sweeps.open_sweep(
        conn,
        spec,
        lease,
        run_id,
        lambda cur, s: sweeps.boundaries(cur, source, {"sweep_id": s["sweep_id"]}, batch_size, 1),
    )
    [rng] = sweeps.range_descriptors(sweep, "FullSweep")
    opts = {**news.DEFAULTS, **(limits or {}), "batch_size": batch_size}
    opts["effective_scope"] = "FullSweep"
    return rng, news.make_batch(opts, sweep["sweep_id"], run_id, candidate_mode=False)


class SlowVacuum:
    """A real VACUUM of ``table`` slowed by its cost delay (about 0.4 s a page, so a few
    thousand rows make it last), running from :meth:`start` until :meth:`cancel`."""

    def __init__(self, dsn: str, table: str):
        self.dsn, self.table = dsn, table
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.pid = self.conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        self.cancelled = threading.Event()

    def start(self) -> SlowVacuum:
        for setting in (
            "vacuum_cost_delay = 100",
            "vacuum_cost_limit = 1",
            "vacuum_cost_page_hit = 10000",
        ):
            self.conn.execute(f"SET {setting}")

        def run():
            try:
                self.conn.execute(f"VACUUM (DISABLE_PAGE_SKIPPING) {self.table}")
            except psycopg.errors.QueryCanceled:
                self.cancelled.set()

        threading.Thread(target=run, daemon=True).start()
        with psycopg.connect(self.dsn, autocommit=True) as c:
            wait_for(
                lambda: c.execute(
                    # a partitioned table's VACUUM runs on its partitions one by one (the
                    # tree of a plain table is empty)
                    "SELECT 1 FROM pg_stat_progress_vacuum WHERE relid = %s::regclass OR relid "
                    "IN (SELECT relid FROM pg_partition_tree(%s::regclass))",
                    (self.table, self.table),
                ).fetchone(),
                timeout=10,
                what=f"the VACUUM of {self.table} in pg_stat_progress_vacuum",
            )
        return self

    def cancel(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as c:
            c.execute("SELECT pg_cancel_backend(%s)", (self.pid,))
        wait_for(self.cancelled.is_set, timeout=10, what="the VACUUM cancelled")
        self.conn.close()

    def cancel_after(self, seconds: float, first: Callable[[], Any]) -> threading.Thread:
        """Cancel it ``seconds`` from now, from another thread, calling ``first()`` just before
        (to note what the test checks against); the thread, started."""

        def later():
            time.sleep(seconds)
            first()
            self.cancel()

        thread = threading.Thread(target=later, daemon=True)
        thread.start()
        return thread


# --- reliability and security tests --------------------------------------------------------


def bulk_posts(
    db: NewsDB, n: int, rnd: random.Random, drift_share: float = 0.0
) -> tuple[list[str], dict[str, int]]:
    """n Published posts with ~3 comments each on average (Pareto-spread; visible, hidden and
    deleted), made by the shared generator (tools/datagen.py); a share of them drifted by a
    non-zero offset. Every post's ``updated_at`` is 2026-01-01. Returns (ids, {post: offset})."""
    from tools import datagen

    datagen.news(
        db.dsn, n, 3 * n, seed=rnd.uniform(-0.5, 0.5), drift=drift_share, archived=0, schema=False
    )
    db.conn.execute("UPDATE news.posts SET updated_at = '2026-01-01 00:00+00'")
    db.conn.execute("VACUUM ANALYZE news.posts")
    ids = [r[0] for r in db.q("SELECT id::text FROM news.posts ORDER BY id")]
    return ids, {p: off for p, off in post_offsets(db).items() if off != 0}


def post_offsets(db: NewsDB) -> dict[str, int]:
    """comments_count minus the visible comments, for every post (0 = correct)."""
    return dict(
        db.q(
            "SELECT p.id::text, p.comments_count - (SELECT count(*) FROM news.comments c "
            "WHERE c.post_id = p.id AND c.status = 'Visible') FROM news.posts p"
        )
    )


def reference_popularity_score(snaps: dict, d, w: int, h: float, inherited=None):
    """score(D) = round(sum over snapshots k in (D-W, D] of max(0, S_k - S_prev) * 2^(-(D-k)/H), 4),
    S_prev the newest earlier snapshot with run_date >= D - (W + 2) (none: a baseline, delta 0);
    computed in Python with 40-digit decimals, independently of the job's SQL. ``inherited``:
    (score, night E) kept through the first nights, adding score * 2^(-(D-E)/H) while D - E < W."""
    from decimal import Decimal, localcontext

    with localcontext() as ctx:
        ctx.prec = 40
        history = sorted((k, v) for k, v in snaps.items() if d - timedelta(days=w + 2) <= k <= d)
        total = Decimal(0)
        for (_, prev), (k, v) in zip(history, history[1:]):
            age = (d - k).days
            if age < w:
                total += Decimal(max(0, v - prev)) * Decimal(2) ** (Decimal(-age) / Decimal(str(h)))
        if inherited and 0 <= (age := (d - inherited[1]).days) < w:
            total += Decimal(inherited[0]) * Decimal(2) ** (Decimal(-age) / Decimal(str(h)))
        return total.quantize(Decimal("0.0001"))


ADVISORY_KEY = 7_404_242


def install_gate(
    db: NewsDB, table: str, post_id: str, key: int = ADVISORY_KEY, hold: str | None = None
) -> None:
    """A BEFORE UPDATE trigger on ``table`` that, for row ``post_id``, waits for the advisory
    lock ``key``: whoever holds that lock keeps the writer's batch in flight, until the job's
    lock_timeout cuts the wait or, with ``hold`` (e.g. ``'5min'``), that long (for a test that
    must hold the batch longer than a slow machine may take to act on it)."""
    setting = f"SET lock_timeout = '{hold}' " if hold else ""
    db.q(
        "CREATE OR REPLACE FUNCTION public.pin_test_gate() RETURNS trigger LANGUAGE plpgsql "
        f"{setting}AS $$ BEGIN IF NEW.id = '{post_id}'::uuid THEN "
        f"PERFORM pg_advisory_xact_lock({int(key)}); END IF; RETURN NEW; END $$"
    )
    db.q(
        f"CREATE TRIGGER pin_test_gate BEFORE UPDATE ON {table} FOR EACH ROW "
        "EXECUTE FUNCTION public.pin_test_gate()"
    )


def remove_gate(db: NewsDB, table: str) -> None:
    db.q(f"DROP TRIGGER IF EXISTS pin_test_gate ON {table}")


@contextlib.contextmanager
def held_at_gate(db: NewsDB, table: str, row: str, hold: str = "5min", **connect: Any):
    """Within the block, a writer of ``table``'s row ``row`` waits at the gate (see
    ``install_gate``) for the advisory lock a connection of the test holds. The block gets
    ``release``, which frees the writer and removes the gate; leaving the block calls it if the
    block did not, whatever the block raised."""
    install_gate(db, table, row, hold=hold)
    gate = psycopg.connect(db.dsn, autocommit=True, **connect)
    gate.execute("SELECT pg_advisory_lock(%s)", (ADVISORY_KEY,))

    def release() -> None:
        if not gate.closed:
            gate.execute("SELECT pg_advisory_unlock(%s)", (ADVISORY_KEY,))
            gate.close()
            remove_gate(db, table)

    try:
        yield release
    finally:
        release()


def gate_waiter(db: NewsDB, key: int = ADVISORY_KEY) -> int | None:
    """Pid of a backend waiting for the advisory lock ``key`` (a batch held at the gate)."""
    rows = db.q(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
        "AND objid = %s AND database = (SELECT oid FROM pg_database "
        "WHERE datname = current_database())",
        key,
    )
    return rows[0][0] if rows else None


def wait_for(
    condition: Callable[[], Any], timeout: float = 30, poll: float = 0.02, what: str = "condition"
) -> Any:
    """Poll until ``condition()`` is truthy; return its value; fail after ``timeout`` seconds."""
    return wait_until(condition, timeout, what=what, poll=poll)


class Webhook:
    """A local HTTP listener standing in for the alert channel."""

    def __init__(self):
        received = self.received = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                received.append(json.loads(body))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def connection(self) -> str:
        """The pin_alerts connection (AIRFLOW_CONN_PIN_ALERTS) that points here."""
        return json.dumps({"conn_type": "http", "host": f"http://127.0.0.1:{self.port}/alerts"})

    def wait_for(self, pred, timeout: float = 90):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hits = [r for r in self.received if pred(r)]
            if hits:
                return hits
            time.sleep(0.5)
        raise AssertionError(f"no matching alert; received {self.received}")


def stack_databases(name: str) -> tuple[str, str, str, dict[str, str]]:
    """Fresh databases for a stack test ``name``: news and catalog (with their domain tables)
    and Airflow's metadata (migrated, the pools imported: the stack is ``migrated``), and the
    environment of the two job connections."""
    from tests.conftest import SUFFIX
    from tools import devenv
    from tools.datagen import create_catalog_schema, create_news_schema

    news_dsn = devenv.recreate_database(f"pin_{name}_news{SUFFIX}")
    create_news_schema(news_dsn)
    catalog_dsn = devenv.recreate_database(f"pin_{name}_catalog{SUFFIX}")
    create_catalog_schema(catalog_dsn)
    metadata_dsn = devenv.postgres_metadata(f"pin_{name}_airflow{SUFFIX}")
    conns = {
        "AIRFLOW_CONN_NEWS_DB": devenv.airflow_connection(news_dsn),
        "AIRFLOW_CONN_CATALOG_DB": devenv.airflow_connection(catalog_dsn),
    }
    return news_dsn, catalog_dsn, metadata_dsn, conns


def skip_module(reason: str) -> None:
    """Skip the calling test module, printing why (a tool it needs is missing)."""
    print(f"\n[skip] {reason}")
    pytest.skip(reason, allow_module_level=True)


def require_tool(name: str, what: str, package: str | None = None) -> str:
    """The path of the system tool ``name`` (Debian's ``package``), or the calling module
    skipped, saying what needs it and how to install it."""
    import shutil

    path = shutil.which(name)
    if path is None:
        package = package or name
        skip_module(
            f"{name} is not installed: {what} (apt-get install {package}; .ci/run installs it "
            "when CI=true)"
        )
    return path
