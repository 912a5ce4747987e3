"""How long a 4-range news FullSweep takes on the CeleryExecutor with 1 and with 2 workers
(docs/operations.md, "Scale-out"): the benchmark's news data (``bench/data.py``, generated
once per scale, its counters restored before every run), a throw-away Redis, and a
:class:`CeleryStack` whose news pool has as many slots as ranges, so that only the workers
limit how many ranges run at once (workers x concurrency).

    .venv/bin/python -m bench.celery_timing [--scale 0.25] [--batch-size 50] [--repeat 2]
                                            [--setups 1x1,2x1,1x2,2x2]

Prints, per setup, each run's duration (the DAG run, from its start to its end), the ranges' wall
time (first range start to last range end), the longest range and how many ranges ran at once.
Needs ``redis-server`` (Debian's package). The Airflow logs are in ``.airflow/celery-timing/``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
from datetime import datetime
from pathlib import Path

from tools import devenv
from tools.stack import CeleryStack, Redis, celery_settings, free_port, stack_env

NEWS, CATALOG = "news_comment_reconcile", "catalog_popularity_recompute"
RANGES = 4
# workers x concurrency of each
SETUPS = "1x1,2x1,1x2,2x2"


def _seconds(a: str, b: str) -> float:
    return (datetime.fromisoformat(b) - datetime.fromisoformat(a)).total_seconds()


def most_at_once(spans: list[tuple[str, str]]) -> int:
    starts = [(datetime.fromisoformat(a), 1) for a, _ in spans]
    ends = [(datetime.fromisoformat(b), -1) for _, b in spans]
    running = peak = 0
    for _, step in sorted(starts + ends):  # an end before a start at the same instant
        running += step
        peak = max(peak, running)
    return peak


def measure(stack: CeleryStack, dsn: str, batch_size: int) -> dict:
    from bench.data import reset_news

    reset_news(dsn)
    run_id = stack.trigger(
        NEWS, {"scope": "FullSweep", "max_ranges": RANGES, "batch_size": batch_size}
    )
    if stack.wait_run(NEWS, run_id, timeout=1800) != "success":
        raise RuntimeError(f"{run_id} failed; see {stack.home}")
    run = stack.get(f"/api/v2/dags/{NEWS}/dagRuns/{run_id}")
    tis = stack.get(f"/api/v2/dags/{NEWS}/dagRuns/{run_id}/taskInstances?limit=100")
    ranges = [t for t in tis["task_instances"] if t["task_id"] == "reconcile_range"]
    if len(ranges) != RANGES:
        raise RuntimeError(f"expected {RANGES} ranges, got {len(ranges)}")
    spans = [(t["start_date"], t["end_date"]) for t in ranges]
    return {
        "run": _seconds(run["start_date"], run["end_date"]),
        "ranges": _seconds(min(a for a, _ in spans), max(b for _, b in spans)),
        "longest": max(_seconds(a, b) for a, b in spans),
        "at_once": most_at_once(spans),
        "hosts": len({t["hostname"] for t in ranges}),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--setups", default=SETUPS, help=f"workers x concurrency ({SETUPS})")
    args = parser.parse_args()
    # SIGTERM (also the only stop signal of a background job) stops the stack, Redis and the
    # embedded PostgreSQL like Ctrl-C does
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    import psycopg

    from bench.common import db_name
    from bench.data import ensure_news
    from tools.datagen import create_catalog_schema

    meta = ensure_news(args.scale)
    news_dsn = devenv.dsn_for(db_name("news", args.scale))
    catalog_dsn = devenv.recreate_database("pin_celery_timing_catalog")
    create_catalog_schema(catalog_dsn)  # empty: the catalog DAG's scheduled run does nothing
    metadata_dsn = devenv.recreate_database("pin_celery_timing_airflow")
    home = devenv.REPO / ".airflow" / "celery-timing"
    with psycopg.connect(news_dsn) as conn:
        posts = conn.execute(
            "SELECT count(*) FROM news.posts WHERE status IS DISTINCT FROM 'Archived'"
        ).fetchone()[0]
    print(
        f"news data: scale {args.scale:g}, {posts:,} posts in the FullSweep "
        f"({meta['facts']}); batch_size {args.batch_size}; {os.cpu_count()} cores",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="pin-redis-") as tmp:
        redis = Redis(Path(tmp)).start()
        stack = None
        try:
            env = stack_env(
                home,
                metadata_dsn,
                free_port(),
                {
                    "AIRFLOW_CONN_NEWS_DB": devenv.airflow_connection(news_dsn),
                    "AIRFLOW_CONN_CATALOG_DB": devenv.airflow_connection(catalog_dsn),
                    "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
                },
            )
            env.update(celery_settings(env, redis.url))
            stack = CeleryStack(home, env).start()
            stack.wait_for_dags([NEWS, CATALOG])
            stack.start_worker("warm-up")
            stack.wait_idle([NEWS, CATALOG])
            stack.request(
                "PATCH",
                f"/api/v2/pools/{NEWS}?update_mask=slots",
                {"pool": NEWS, "slots": RANGES, "include_deferred": False},
            )
            rows = []
            for setup in args.setups.split(","):
                workers, concurrency = map(int, setup.split("x"))
                for name in list(stack.workers):
                    stack.stop_worker(name)
                for i in range(workers):
                    stack.start_worker(f"t{workers}x{concurrency}n{i}", concurrency=concurrency)
                measure(stack, news_dsn, args.batch_size)  # warm-up: not counted
                results = [measure(stack, news_dsn, args.batch_size) for _ in range(args.repeat)]
                med = {k: statistics.median(r[k] for r in results) for k in results[0]}
                rows.append((workers, concurrency, med, results))
                print(
                    f"{workers} worker(s) x concurrency {concurrency}: run {med['run']:.1f} s, "
                    f"ranges {med['ranges']:.1f} s (longest {med['longest']:.1f} s), "
                    f"{med['at_once']:g} at once on {med['hosts']:g} worker(s)  "
                    f"[runs: {', '.join(format(r['run'], '.1f') for r in results)}]",
                    flush=True,
                )
        finally:
            if stack is not None:
                stack.stop()
            redis.stop()
    print("\n| workers x concurrency | ranges at once | DAG run | the 4 ranges | longest range |")
    print("|---|---|---|---|---|")
    for workers, concurrency, med, _ in rows:
        print(
            f"| {workers} x {concurrency} | {med['at_once']:g} | {med['run']:.1f} s | "
            f"{med['ranges']:.1f} s | {med['longest']:.1f} s |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
