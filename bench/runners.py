"""The measured things: the set-based floors, the job code (plan + ranges in worker processes),
and a whole DAG run through Airflow (in a subprocess).

The job code is driven exactly as the DAG tasks drive it, minus Airflow: ``validate_options``,
``jobs.acquire_lease`` (preflight + lease), ``plan_ranges`` (``keyset.open_sweep`` with the
job's own sweep spec and plan closure), ``keyset.run_range`` with the job's ``make_batch`` in one
worker process per range, then ``summarize`` and ``jobs.release_lease``, with the values the
DAG's tasks pass (a run id of the benchmark's own, the run's instant, the lease).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime
from datetime import time as dtime
from pathlib import Path

from bench import variants
from bench.common import AS_OF, LOGS, REPO, read_status_kb

log = logging.getLogger("bench.runners")

BIG_BUDGET = {"max_run_duration_minutes": 600, "lock_ttl_minutes": 720}


# ---------------------------------------------------------------------------------------------
# worker processes
# ---------------------------------------------------------------------------------------------


class Worker:
    def __init__(self, dsn: str, variant: str, log_path: Path) -> None:
        self.log_file = open(log_path, "a")
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.worker"],
            cwd=str(REPO),
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log_file,
            text=True,
            bufsize=1,
        )
        self.request({"dsn": dsn, "variant": variant})
        self.ready = self.read()

    def request(self, obj) -> None:
        self.proc.stdin.write(json.dumps(obj, default=str) + "\n")
        self.proc.stdin.flush()

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(
                f"worker {self.proc.pid} died (exit {self.proc.returncode}); "
                f"see {self.log_file.name}"
            )
        return json.loads(line)

    def close(self) -> dict:
        try:
            self.request({"quit": True})
            final = self.read()
        finally:
            self.proc.wait(timeout=60)
            self.log_file.close()
        return final


class WorkerPool:
    """``n`` worker processes, each with its own connection; tasks go to whichever is free."""

    def __init__(self, n: int, dsn: str, variant: str, tag: str) -> None:
        path = LOGS / f"workers-{tag}.log"
        self.workers = [Worker(dsn, variant, path) for _ in range(n)]

    def run(self, tasks: list[dict]) -> list[dict]:
        todo: queue.Queue = queue.Queue()
        for i, t in enumerate(tasks):
            todo.put((i, t))
        results: list[dict | None] = [None] * len(tasks)
        errors: list[BaseException] = []

        def loop(w: Worker) -> None:
            while True:
                try:
                    i, t = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    w.request(t)
                    results[i] = {**w.read(), "worker_pid": w.proc.pid}
                except BaseException as exc:  # noqa: BLE001
                    errors.append(exc)
                    return

        threads = [threading.Thread(target=loop, args=(w,)) for w in self.workers]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            raise errors[0]
        return results  # type: ignore[return-value]

    def close(self) -> list[dict]:
        return [w.close() for w in self.workers]


# ---------------------------------------------------------------------------------------------
# the job code without Airflow
# ---------------------------------------------------------------------------------------------


def bench_run_id(logical: datetime) -> str:
    return f"bench__{logical.isoformat()}__{uuid.uuid4().hex[:8]}"


def warm_up(conn_id: str) -> None:
    """Import what the first hook connection and the metrics facade import (not timed)."""
    from pin_nightly import db, metrics

    with db.connection(conn_id):
        pass
    metrics.gauge(f"{metrics.NEWS}_drift_alert_threshold", 0)  # a declared metric


def _range_stats(results: list[dict]) -> dict:
    lock = [ms for r in results for ms in r["lock_ms"]]
    lock_log = [ms for r in results for ms in r["lock_ms_log"]]
    stmts: dict[str, list] = {}
    for r in results:
        for k, (n, s) in r["statements"].items():
            acc = stmts.setdefault(k, [0, 0.0])
            acc[0] += n
            acc[1] += s
    first, last = [], []
    for r in results:
        ls = r.get("lock_stmt_ms") or []
        k = max(1, len(ls) // 10)
        if len(ls) >= 10:
            first.append(sum(ls[:k]) / k)
            last.append(sum(ls[-k:]) / k)
    totals = {
        k: sum(r["result"][k] for r in results)
        for k in ("batches", "processed", "changed", "written", "skipped_locked", "item_errors")
    }
    return {
        "lock_ms": lock,
        "lock_ms_log": lock_log,
        "statements": stmts,
        **totals,
        # the batch lock statement, mean of the first and of the last tenth of the batches
        # of a range: equal when each batch costs the same wherever it is in the keyset
        "lock_stmt_first10_ms": sum(first) / len(first) if first else None,
        "lock_stmt_last10_ms": sum(last) / len(last) if last else None,
        "ranges": len(results),
        "range_seconds": [round(r["t_end"] - r["t_start"], 3) for r in results],
        "worker_hwm_kb": max((r["hwm_kb"] or 0) for r in results) if results else None,
    }


def run_news_job(pool: WorkerPool, scope: str, n_ranges: int, variant: variants.Variant) -> dict:
    from pin_nightly import jobs, news

    variants.install(variant)
    instant = datetime.now(UTC)
    run_id = bench_run_id(instant)
    params = {
        "scope": scope,
        "max_ranges": n_ranges,
        **BIG_BUDGET,
        "batch_size": variants.batch_size(variant, "news", news.DEFAULTS["batch_size"]),
        "drift_alert_threshold": 10**9,
    }
    t0 = time.perf_counter()
    opts = news.validate_options(params, instant)
    lease_data = jobs.acquire_lease(news.JOB, opts, run_id)
    ranges = news.plan_ranges(opts, lease_data, run_id)
    t_plan = time.perf_counter()
    tasks = [
        {
            "job": "news",
            "rng": r,
            "lease": lease_data,
            "opts": opts,
            "run_id": run_id,
            "candidate_mode": scope != "FullSweep",
        }
        for r in ranges
    ]
    results = pool.run(tasks)
    t_ranges = time.perf_counter()
    summary = news.summarize(opts, lease_data, run_id)
    jobs.release_lease(news.JOB, lease_data)
    t1 = time.perf_counter()
    if summary["status"] != "success":
        raise RuntimeError(f"news job did not finish: {summary}")
    return {
        "seconds": t1 - t0,
        "plan_s": t_plan - t0,
        "ranges_s": t_ranges - t_plan,
        "finish_s": t1 - t_ranges,
        "rows": summary["posts_reconciled"],
        "changed": summary["drift_corrected"],
        "summary": summary,
        **_range_stats(results),
    }


def run_catalog_job(pool: WorkerPool, n_ranges: int, variant: variants.Variant) -> dict:
    from pin_nightly import catalog, jobs

    variants.install(variant)
    instant = datetime.combine(AS_OF, dtime(3, 0), tzinfo=UTC)
    run_id = bench_run_id(instant)
    params = {
        "max_ranges": n_ranges,
        **BIG_BUDGET,
        "batch_size": variants.batch_size(variant, "catalog", catalog.DEFAULTS["batch_size"]),
    }
    t0 = time.perf_counter()
    opts = catalog.validate_options(params, instant)
    lease_data = jobs.acquire_lease(catalog.JOB, opts, run_id)
    results: list[dict] = []
    plan_s = 0.0
    for kind in catalog.KINDS:
        tp = time.perf_counter()
        ranges = catalog.plan_ranges(kind, opts, lease_data, run_id)
        plan_s += time.perf_counter() - tp
        results += pool.run(
            [
                {
                    "job": "catalog",
                    "kind": kind,
                    "rng": r,
                    "lease": lease_data,
                    "opts": opts,
                    "run_id": run_id,
                }
                for r in ranges
            ]
        )
    t_ranges = time.perf_counter()
    pruned = catalog.retention(opts, lease_data)
    summary = catalog.summarize(opts, pruned, lease_data, run_id)
    jobs.release_lease(catalog.JOB, lease_data)
    t1 = time.perf_counter()
    if summary["status"] != "success":
        raise RuntimeError(f"catalog job did not finish: {summary}")
    rows = summary["property_object_cards_processed"] + summary["project_cards_processed"]
    return {
        "seconds": t1 - t0,
        "plan_s": plan_s,
        "ranges_s": t_ranges - t0 - plan_s,
        "finish_s": t1 - t_ranges,
        "rows": rows,
        "changed": summary["property_object_cards_updated"] + summary["project_cards_updated"],
        "summary": summary,
        **_range_stats(results),
    }


# ---------------------------------------------------------------------------------------------
# the floors: the whole job as one set-based statement
# ---------------------------------------------------------------------------------------------

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

# The same, restricted to the DailyWindow's candidates (posts with a comment changed since the
# cutoff): what the window would cost as one statement.
NEWS_WINDOW_FLOOR = """
UPDATE news.posts p
   SET comments_count = t.n, updated_at = clock_timestamp()
  FROM (SELECT q.id, coalesce(v.n, 0)::integer AS n
          FROM news.posts q
          LEFT JOIN (SELECT post_id, count(*) AS n FROM news.comments
                      WHERE status = 'Visible'
                        AND post_id IN (SELECT post_id FROM news.comments
                                         WHERE updated_at >= %(cutoff)s)
                      GROUP BY post_id) v ON v.post_id = q.id
         WHERE q.status IS DISTINCT FROM 'Archived'
           AND q.id IN (SELECT post_id FROM news.comments WHERE updated_at >= %(cutoff)s)) t
 WHERE p.id = t.id AND p.comments_count IS DISTINCT FROM t.n
"""

CATALOG_FLOOR_SNAPSHOTS = """
INSERT INTO catalog.popularity_daily_views
       (card_kind, card_id, run_date, cumulative_views, created_at)
SELECT 'PropertyObject', id, %(as_of)s::date, popularity_views, clock_timestamp()
  FROM catalog.property_object_cards
 WHERE status IS DISTINCT FROM 'Delisted' AND popularity_views >= 0
UNION ALL
SELECT 'Project', id, %(as_of)s::date, popularity_views, clock_timestamp()
  FROM catalog.project_cards
 WHERE status IS DISTINCT FROM 'Delisted' AND popularity_views >= 0
ON CONFLICT (card_kind, card_id, run_date) DO UPDATE
   SET cumulative_views = excluded.cumulative_views, created_at = excluded.created_at
"""

CATALOG_FLOOR_SCORES = """
WITH hist AS (
    SELECT card_kind, card_id, run_date, cumulative_views
      FROM catalog.popularity_daily_views
     WHERE run_date >= %(as_of)s::date - %(window_days)s AND run_date <= %(as_of)s::date
), deltas AS (
    SELECT card_kind, card_id, run_date,
           cumulative_views - lag(cumulative_views) OVER w AS delta
      FROM hist
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
SELECT (SELECT count(*) FROM po), (SELECT count(*) FROM pr)
"""


def news_floor(dsn: str, window_cutoff: datetime | None = None) -> dict:
    import psycopg

    with psycopg.connect(dsn) as conn:
        if window_cutoff is None:
            rows = conn.execute(
                "SELECT count(*) FROM news.posts WHERE status IS DISTINCT FROM 'Archived'"
            ).fetchone()[0]
        else:
            rows = conn.execute(
                "SELECT count(DISTINCT c.post_id) FROM news.comments c JOIN news.posts p "
                "ON p.id = c.post_id AND p.status IS DISTINCT FROM 'Archived' "
                "WHERE c.updated_at >= %s",
                (window_cutoff,),
            ).fetchone()[0]
        conn.commit()
        t0 = time.perf_counter()
        if window_cutoff is None:
            changed = conn.execute(NEWS_FLOOR).rowcount
        else:
            changed = conn.execute(NEWS_WINDOW_FLOOR, {"cutoff": window_cutoff}).rowcount
        conn.commit()
        dt = time.perf_counter() - t0
    return {
        "seconds": dt,
        "rows": rows,
        "changed": changed,
        "statements": 1,
        "lock_ms": [dt * 1000],
    }


def catalog_floor(dsn: str) -> dict:
    import psycopg

    from pin_nightly import catalog

    p = {
        "as_of": AS_OF,
        "window_days": catalog.DEFAULTS["window_days"],
        "half_life": catalog.DEFAULTS["half_life_days"],
    }
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("""
            SELECT (SELECT count(*) FROM catalog.property_object_cards
                     WHERE status IS DISTINCT FROM 'Delisted')
                 + (SELECT count(*) FROM catalog.project_cards
                     WHERE status IS DISTINCT FROM 'Delisted')""").fetchone()[0]
        conn.commit()
        t0 = time.perf_counter()
        written = conn.execute(CATALOG_FLOOR_SNAPSHOTS, p).rowcount
        t_snap = time.perf_counter()
        po, pr = conn.execute(CATALOG_FLOOR_SCORES, p).fetchone()
        conn.commit()
        dt = time.perf_counter() - t0
    return {
        "seconds": dt,
        "snapshots_s": t_snap - t0,
        "rows": rows,
        "written": written,
        "changed": po + pr,
        "statements": 2,
        "lock_ms": [dt * 1000],
    }


# ---------------------------------------------------------------------------------------------
# a whole DAG run through Airflow, in its own process
# ---------------------------------------------------------------------------------------------


def run_dag_subprocess(
    dag_id: str, conf: dict, logical: datetime, conns: dict[str, str], tag: str
) -> dict:
    env = {**os.environ, **conns}
    cmd = [sys.executable, "-m", "bench.dagrun", dag_id, json.dumps(conf), logical.isoformat()]
    with open(LOGS / f"dagrun-{tag}.log", "a") as errlog:
        proc = subprocess.run(
            cmd, cwd=str(REPO), env=env, stdout=subprocess.PIPE, stderr=errlog, text=True
        )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"DAG run {dag_id} failed (exit {proc.returncode}); see {LOGS / f'dagrun-{tag}.log'}"
        )
    return json.loads(lines[-1])


def own_rss_kb() -> int | None:
    return read_status_kb("VmRSS")
