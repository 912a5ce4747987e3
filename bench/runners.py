"""The measured things: the set-based floors, the job code (plan + ranges in worker processes),
retention, the write-footprint probe and the hot-path load.

The job code is driven as the DAG tasks drive it, minus Airflow: ``validate_options``,
``jobs.acquire_lease``, ``runs.plan``, ``ranges.run_range`` with the job's ``make_batch`` in
one worker process per range, ``runs.summarize``, ``runs.release_lease``.
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from datetime import time as dtime

from bench.common import AS_OF, LOGS, REPO
from tools import pgbench

BIG_BUDGET = {"max_run_duration_minutes": 600, "lock_ttl_minutes": 720}
# the hot path's sessions log each row-lock wait longer than 5 ms (superuser settings)
LOCK_LOG = {"log_lock_waits": "on", "deadlock_timeout": "5ms"}


# what a job session's wal_compression is in the measurements: the server's (off) unless an item
# says otherwise (db.WAL_COMPRESSION: the best method the server has, where the role may)
os.environ.setdefault("PIN_WAL_COMPRESSION", "off")


def _spawn(args: list[str], log_name: str, env_extra: dict | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")} | (env_extra or {})
    return subprocess.Popen(
        [sys.executable, "-m", *args],
        cwd=str(REPO),
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=open(LOGS / log_name, "a"),  # noqa: SIM115 - lives as long as the process
        text=True,
        bufsize=1,
    )


class Worker:
    """A ``bench.worker`` process: a JSON line in, a JSON line out; an empty line ends it."""

    def __init__(self, dsn: str, tag: str, env: dict | None = None) -> None:
        self.proc = _spawn(["bench.worker", dsn], f"workers-{tag}.log", env)
        self.ready = self.ask(None)

    def ask(self, line: str | None) -> dict:
        if line is not None:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"worker {self.proc.pid} died; see {LOGS}")
        return json.loads(answer)

    def close(self) -> dict:
        final = self.ask("")
        self.proc.wait(timeout=60)
        return final


class Pool:
    """``n`` worker processes; each task (a range) goes to whichever is free."""

    def __init__(self, n: int, dsn: str, tag: str, env: dict | None = None) -> None:
        self.workers = [Worker(dsn, tag, env) for _ in range(n)]
        self.free: queue.Queue = queue.Queue()
        for w in self.workers:
            self.free.put(w)

    def run(self, tasks: list[dict]) -> list[dict]:
        def one(task: dict) -> dict:
            w = self.free.get()
            try:
                return w.ask(json.dumps(task, default=str))
            finally:
                self.free.put(w)

        with ThreadPoolExecutor(len(self.workers)) as ex:
            return list(ex.map(one, tasks))

    def close(self) -> list[dict]:
        return [w.close() for w in self.workers]


def _run_id(instant: datetime) -> str:
    return f"bench__{instant.isoformat()}__{uuid.uuid4().hex[:8]}"


def _ranges_stats(results: list[dict]) -> dict:
    stmts: dict[str, list] = {}
    for r in results:
        for k, (n, s) in r["statements"].items():
            acc = stmts.setdefault(k, [0, 0.0])
            acc[0] += n
            acc[1] += s
    keys = ("batches", "processed", "changed", "written", "skipped_locked", "item_errors")
    return {
        "batch_ms": [ms for r in results for ms in r["batch_ms"]],
        "lock_ms": [ms for r in results for ms in r.get("lock_ms", [])],
        "statements": stmts,
        **{k: sum(r["result"][k] for r in results) for k in keys},
        "worker_hwm_kb": max(r["hwm_kb"] for r in results) if results else None,
    }


def _pacing(paced: bool) -> dict:
    """The pacing params of a measured run: off (the job's own cost) unless ``paced`` (the
    DAG's defaults, as a nightly run paces)."""
    from pin_nightly import health

    if paced:
        return {}
    return {lim.param: (False if lim.default is True else 0) for lim in health.LIMITS}


def run_news(
    pool: Pool, scope: str, n_ranges: int, paced: bool = False, extra: dict | None = None
) -> dict:
    from pin_nightly import jobs, news, runs

    instant = datetime.now(UTC)
    run_id = _run_id(instant)
    params = {"scope": scope, "max_ranges": n_ranges, **BIG_BUDGET, **_pacing(paced)}
    params.update(extra or {})
    t0 = time.perf_counter()
    opts = news.validate_options({**params, "drift_alert_threshold": 10**9}, instant)
    lease = jobs.acquire_lease(news.JOB, opts, run_id)
    run = runs.Run.of(news.JOB, opts, run_id, lease)
    ranges = runs.plan(run)
    t_plan = time.perf_counter()
    mode = scope != "FullSweep"
    results = pool.run(
        [
            {"job": "news", "rng": r, "lease": lease, "opts": opts, "run_id": run_id}
            | {"candidate_mode": mode}
            for r in ranges
        ]
    )
    summary = runs.summarize(run)
    runs.release_lease(run)
    t1 = time.perf_counter()
    if summary["status"] != "success":
        raise RuntimeError(f"news job did not finish: {summary}")
    return {
        "seconds": t1 - t0,
        "plan_s": t_plan - t0,
        "rows": summary["posts_reconciled"],
        "changed": summary["drift_corrected"],
        **_ranges_stats(results),
    }


def run_catalog(pool: Pool, n_ranges: int, paced: bool = False) -> dict:
    from pin_nightly import catalog, jobs, runs

    instant = datetime.combine(AS_OF, dtime(3, 0), tzinfo=UTC)
    run_id = _run_id(instant)
    t0 = time.perf_counter()
    params = {"max_ranges": n_ranges, **BIG_BUDGET, **_pacing(paced)}
    opts = catalog.validate_options(params, instant)
    lease = jobs.acquire_lease(catalog.JOB, opts, run_id)
    run = runs.Run.of(catalog.JOB, opts, run_id, lease)
    results, plan_s = [], 0.0
    for kind in catalog.KINDS:
        tp = time.perf_counter()
        ranges = runs.plan(run, kind)
        plan_s += time.perf_counter() - tp
        base = {"job": "catalog", "kind": kind, "lease": lease, "opts": opts, "run_id": run_id}
        results += pool.run([{**base, "rng": r} for r in ranges])
    pruned = catalog.retention(run)
    summary = runs.summarize(run, pruned=pruned)
    runs.release_lease(run)
    t1 = time.perf_counter()
    if summary["status"] != "success":
        raise RuntimeError(f"catalog job did not finish: {summary}")
    return {
        "seconds": t1 - t0,
        "plan_s": plan_s,
        "rows": summary["property_object_cards_processed"] + summary["project_cards_processed"],
        "changed": summary["property_object_cards_updated"] + summary["project_cards_updated"],
        **_ranges_stats(results),
    }


def run_retention(wal_compression: str = "off") -> dict:
    """The job's retention step two nights after AS_OF: it drops the oldest night of history,
    as every night in steady state (lease and release around it, as the DAG does)."""
    from pin_nightly import catalog, jobs, runs

    instant = datetime.combine(AS_OF + timedelta(days=2), dtime(3, 0), tzinfo=UTC)
    opts = catalog.validate_options(dict(BIG_BUDGET), instant)
    run_id = _run_id(instant)
    os.environ["PIN_WAL_COMPRESSION"] = wal_compression
    try:
        run = runs.Run.of(catalog.JOB, opts, run_id, jobs.acquire_lease(catalog.JOB, opts, run_id))
        t0 = time.perf_counter()
        pruned = catalog.retention(run)
        dt = time.perf_counter() - t0
        runs.release_lease(run)
    finally:
        os.environ["PIN_WAL_COMPRESSION"] = "off"
    batches = 1  # one partition a night, detached and dropped in one transaction
    return {
        "seconds": dt,
        "rows": pruned,
        "changed": pruned,
        "batches": batches,
        "batch_ms": [dt * 1000 / batches] * batches,  # their mean: the job does not time each
    }


NEWS_FLOOR = """
UPDATE news.posts p
   SET comments_count = t.n, updated_at = clock_timestamp()
  FROM (SELECT q.id, coalesce(v.n, 0)::integer AS n
          FROM news.posts q
          LEFT JOIN (SELECT post_id, count(*) AS n FROM news.comments
                      WHERE status = 'Visible' GROUP BY post_id) v ON v.post_id = q.id
         WHERE q.status IS DISTINCT FROM 'Archived') t
 WHERE p.id = t.id AND p.comments_count IS DISTINCT FROM t.n
"""

CATALOG_FLOOR = (
    """
INSERT INTO catalog.popularity_daily_views
       (id, card_kind, card_id, run_date, cumulative_views, created_at)
SELECT {uuid7_now}, *
  FROM (SELECT 'PropertyObject', id, %(as_of)s::date, popularity_views, clock_timestamp()
          FROM catalog.property_object_cards
         WHERE status IS DISTINCT FROM 'Delisted' AND popularity_views >= 0
        UNION ALL
        SELECT 'Project', id, %(as_of)s::date, popularity_views, clock_timestamp()
          FROM catalog.project_cards
         WHERE status IS DISTINCT FROM 'Delisted' AND popularity_views >= 0) s
ON CONFLICT (card_kind, card_id, run_date) DO UPDATE
   SET cumulative_views = excluded.cumulative_views, created_at = excluded.created_at
""",
    """
WITH deltas AS (
    SELECT card_kind, card_id, run_date,
           cumulative_views - lag(cumulative_views) OVER w AS delta
      FROM catalog.popularity_daily_views
     WHERE run_date >= %(as_of)s::date - %(window_days)s AND run_date <= %(as_of)s::date
    WINDOW w AS (PARTITION BY card_kind, card_id ORDER BY run_date)
), weights AS (
    SELECT age, power(2::numeric, -age::numeric / %(half_life)s::numeric) AS weight
      FROM generate_series(0, %(window_days)s - 1) AS age
), scores AS (
    SELECT d.card_kind, d.card_id,
           round(coalesce(sum(greatest(d.delta, 0) * w.weight), 0), 4) AS score
      FROM deltas d
      LEFT JOIN weights w ON w.age = %(as_of)s::date - d.run_date AND d.delta IS NOT NULL
     GROUP BY d.card_kind, d.card_id
), po AS (
    UPDATE catalog.property_object_cards c
       SET popularity_score = s.score, updated_at = clock_timestamp()
      FROM scores s
     WHERE s.card_kind = 'PropertyObject' AND c.id = s.card_id
       AND c.status IS DISTINCT FROM 'Delisted' AND c.popularity_views >= 0
       AND s.score <= 99999999.9999 AND c.popularity_score IS DISTINCT FROM s.score
    RETURNING 1
), pr AS (
    UPDATE catalog.project_cards c
       SET popularity_score = s.score, updated_at = clock_timestamp()
      FROM scores s
     WHERE s.card_kind = 'Project' AND c.id = s.card_id
       AND c.status IS DISTINCT FROM 'Delisted' AND c.popularity_views >= 0
       AND s.score <= 99999999.9999 AND c.popularity_score IS DISTINCT FROM s.score
    RETURNING 1
)
SELECT (SELECT count(*) FROM po) + (SELECT count(*) FROM pr)
""",
)

ROWS = {
    "news": "SELECT count(*) FROM news.posts WHERE status IS DISTINCT FROM 'Archived'",
    "catalog": "SELECT (SELECT count(*) FROM catalog.property_object_cards "
    "WHERE status IS DISTINCT FROM 'Delisted') + (SELECT count(*) FROM catalog.project_cards "
    "WHERE status IS DISTINCT FROM 'Delisted')",
}


def floor(dsn: str, job: str) -> dict:
    """The whole job as set-based statements in one transaction: every row it changes stays
    locked until the end."""
    import psycopg

    from pin_nightly import catalog

    p = {"as_of": AS_OF, "window_days": catalog.DEFAULTS["window_days"]}
    p["half_life"] = catalog.DEFAULTS["half_life_days"]
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(ROWS[job]).fetchone()[0]
        conn.commit()
        t0 = time.perf_counter()
        if job == "news":
            changed = conn.execute(NEWS_FLOOR).rowcount
        else:
            from pin_nightly.db import sql

            conn.execute(CATALOG_FLOOR[0].replace("{uuid7_now}", sql("common/uuid7_now")), p)
            changed = conn.execute(CATALOG_FLOOR[1], p).fetchone()[0]
        conn.commit()
        dt = time.perf_counter() - t0
        conn.execute("SELECT pg_stat_force_next_flush()")
        conn.commit()
    return {"seconds": dt, "rows": rows, "changed": changed, "batch_ms": [dt * 1000]}


class Footprint:
    """What a run writes, from the server's own statistics: WAL bytes, records and full-page
    images (``pg_stat_wal``), and the 8 kB pages it dirtied, counted as the pages written by
    backends and the background writer during the run plus those the CHECKPOINT after it writes
    (``pg_stat_bgwriter``). A CHECKPOINT before the run makes the full-page images comparable
    (the first change of a page after a checkpoint logs the whole page). The server is otherwise
    idle; connections flush their statistics before the probe reads."""

    WAL = (
        "SELECT wal_bytes, wal_records, wal_fpi, "
        "(SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter) FROM pg_stat_wal"
    )
    PAGES = "SELECT buffers_checkpoint + buffers_clean + buffers_backend FROM pg_stat_bgwriter"

    def __init__(self, dsn: str) -> None:
        import psycopg

        self.conn = psycopg.connect(dsn, autocommit=True)

    def checkpoint(self) -> None:
        """CHECKPOINT, then wait until the checkpointer has reported its statistics (it does
        so after waking the waiting backend)."""
        done = "SELECT checkpoints_req FROM pg_stat_bgwriter"
        before = self.conn.execute(done).fetchone()[0]
        self.conn.execute("CHECKPOINT")
        for _ in range(500):
            if self.conn.execute(done).fetchone()[0] > before:
                return
            time.sleep(0.01)

    def start(self) -> None:
        self.checkpoint()
        self.wal0 = self.conn.execute(self.WAL).fetchone()
        self.pages0 = self.conn.execute(self.PAGES).fetchone()[0]

    def stop(self) -> dict:
        time.sleep(0.3)  # the job's short-lived hook connections flush their statistics at exit
        wal = [int(x - x0) for x, x0 in zip(self.conn.execute(self.WAL).fetchone(), self.wal0)]
        self.checkpoint()
        pages = self.conn.execute(self.PAGES).fetchone()[0] - self.pages0
        keys = ("wal_bytes", "wal_records", "wal_fpi", "checkpoints_during")
        return {**dict(zip(keys, wal)), "pages_written": pages}

    def close(self) -> None:
        self.conn.close()


class HotPath:
    """The hot-path load of ``tools/pgbench.py`` at ``rate`` transactions per second of each
    kind, one pgbench per database: the news comment writes with the counter update and the
    catalog view increments, half of them on the 200 newest rows, the others on a sample of
    the live ones. ``lock_waits``: per kind, the row-lock waits longer than 5 ms of its
    connections, from the server's log (read through SQL: the embedded server writes it to
    ``log`` in its data directory), each as ``(ms, by_job)``: ``by_job`` when a process that
    held the lock was not one of the hot path's (the job's backend), from the ``Process holding
    the lock`` detail of the wait's "still waiting" line; the hot path's transactions also wait
    for each other on their hot rows."""

    WAIT = re.compile(r"\[\d+\] LOG:  process (\d+) acquired \S+ on .+ after ([\d.]+) ms")
    HOLDER = re.compile(r"\[(\d+)\] DETAIL:  Process holding the lock: ([\d, ]+)\.")
    PICK = {  # kind: (script, card table or posts, live rows)
        "news": (pgbench.NEWS, "news.posts", "status IS DISTINCT FROM 'Archived'"),
        "catalog": (
            pgbench.VIEWS,
            "catalog.property_object_cards",
            "status IS DISTINCT FROM 'Delisted' AND popularity_views >= 0",
        ),
    }

    def __init__(self, dsns: dict[str, str], rate: float) -> None:
        import psycopg

        self.load = {}
        for kind, dsn in dsns.items():
            script, table, live = self.PICK[kind]
            newest = f"SELECT id FROM {table} WHERE {live} ORDER BY id DESC LIMIT 200"
            sampled = f"SELECT id FROM {table} TABLESAMPLE SYSTEM (5) REPEATABLE (1) WHERE {live}"
            with psycopg.connect(dsn) as conn:
                hot = [r[0] for r in conn.execute(newest)]
                sample = [r[0] for r in conn.execute(sampled + " LIMIT 20000")] or hot
            self.load[kind] = pgbench.PgBench(
                dsn, script, sample, hot, clients=3, rate=rate, seconds=7200, settings=LOCK_LOG
            )
        self.conn = psycopg.connect(dsns["news"], autocommit=True)
        path = self.conn.execute("SELECT coalesce(pg_current_logfile('stderr'), 'log')")
        self.log = path.fetchone()[0]

    def _log_size(self) -> int:
        return self.conn.execute("SELECT (pg_stat_file(%s)).size", (self.log,)).fetchone()[0]

    def __enter__(self) -> HotPath:
        self.log_start = self._log_size()
        self.started = time.time()
        for load in self.load.values():
            load.start()
        time.sleep(2.0)  # at its rate
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.5)
        self.results = {kind: load.stop() for kind, load in self.load.items()}
        text = self.conn.execute(
            "SELECT pg_read_binary_file(%s, %s, %s)",
            (self.log, self.log_start, self._log_size() - self.log_start),
        ).fetchone()[0]
        ours = {p for load in self.load.values() for p in load.pids}
        holders: dict[int, set[int]] = {}  # waiting pid: who held the lock it waits for
        waits = []  # (pid, ms, by_job)
        for line in text.decode(errors="replace").splitlines():
            if m := self.HOLDER.search(line):
                holders[int(m[1])] = {int(h) for h in m[2].split(",")}
            elif m := self.WAIT.search(line):
                pid = int(m[1])
                waits.append((pid, float(m[2]), bool(holders.pop(pid, set()) - ours)))
        self.lock_waits = {
            kind: [(ms, by_job) for p, ms, by_job in waits if p in load.pids]
            for kind, load in self.load.items()
        }
        self.conn.close()


def latency(records: list, lock_waits: list, aborted: int = 0) -> dict:
    """Count, failures (and clients aborted), latency p50 / p99 / max (ms, from the scheduled
    start) of the transactions, and the longest row-lock wait the server logged (ms; 0 if none
    > 5 ms): of any (``lock_max``) and on a lock the job held (``job_lock_max``)."""
    from bench.common import pct

    ok = [ms for _, ms in records if ms is not None]
    return {
        "n": len(records),
        "failures": len(records) - len(ok) + aborted,
        "p50": pct(ok, 50),
        "p99": pct(ok, 99),
        "max": max(ok, default=None),
        "lock_max": max((ms for ms, _ in lock_waits), default=0.0),
        "job_lock_max": max((ms for ms, by_job in lock_waits if by_job), default=0.0),
    }
