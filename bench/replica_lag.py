"""How long a FullSweep pauses while a replica lags: ``python -m bench.replica_lag``.

On a fresh primary and its streaming hot standby started from the pgserver binaries
(tools/replica.py), two copies of one news data set. On the first, a FullSweep with the DAGs'
default pacing limits and nothing lagging. On the second, the same FullSweep; after its first
batch the standby's replay is stopped for ``--hold`` seconds while another client writes more WAL
than ``pace_max_replica_lag_mb`` allows. Reported: each run's seconds, the time the second spent
paused, and that time against the hold (the job resumes within one recheck of the replay
catching up). Results go to ``bench/out/replica_lag.json``; bench/RESULTS.md quotes them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from datetime import UTC, datetime
from unittest import mock

from bench.common import OUT, setup_airflow_env

LAG_MB = 8  # the run's replica-lag limit in this measurement (the default is 1024)


def _run(dsn: str, hold: float | None, pair) -> dict:
    """One FullSweep of the news job in this process, one range; with ``hold``: the standby's
    replay stopped after the first batch for that many seconds, WAL written past the limit."""
    from pin_nightly import health, jobs, news, ranges, runs
    from pin_nightly.db import connection

    os.environ["AIRFLOW_CONN_NEWS_DB"] = _airflow_conn(dsn)
    instant = datetime.now(UTC)
    run_id = f"bench__{instant.isoformat()}"
    params = {"scope": "FullSweep", "max_ranges": 1, "pace_max_replica_lag_mb": LAG_MB}
    opts = news.validate_options(params, instant)
    paused = [0.0]

    class Measured(health.Health):
        def wait(self, *a, **kw):
            p = super().wait(*a, **kw)
            paused[0] += p.seconds
            return p

    held = threading.Event()

    def lag() -> None:  # another client's WAL (about twice the limit), not replayed meanwhile
        pair.pause_replay()
        pair.primary.sql("CREATE TABLE IF NOT EXISTS public.filler (x text)")
        pair.primary.sql(
            "INSERT INTO public.filler SELECT repeat('x', 1000) "
            f"FROM generate_series(1, {LAG_MB * 2 * 900})"
        )
        time.sleep(hold)
        pair.resume_replay()

    def on_batch(_b) -> None:
        if hold is not None and not held.is_set():
            held.set()
            threading.Thread(target=lag, daemon=True).start()
            time.sleep(0.5)  # the WAL is written before the next batch's check

    t0 = time.perf_counter()
    lease_data = jobs.acquire_lease(news.JOB, opts, run_id)
    run = runs.Run.of(news.JOB, opts, run_id, lease_data)
    [rng] = runs.plan(run)
    job = news.make_batch(opts, rng["sweep_id"], run_id, candidate_mode=False)
    gauge = Measured.from_opts(opts, job.writes, news.JOB.dag_id)
    real_batch = ranges._Range.batch

    def batch(self, *args, **kwargs):  # the hold starts once the first batch has committed
        out = real_batch(self, *args, **kwargs)
        on_batch(out[0])
        return out

    with (
        connection(news.JOB.conn_id) as conn,
        mock.patch.object(ranges._Range, "batch", batch),
    ):
        res = ranges.run_range(conn, rng, run.held(), opts["batch_size"], job, health=gauge)
    summary = runs.summarize(run)
    runs.release_lease(run)
    seconds = time.perf_counter() - t0
    if summary["status"] != "success":
        raise RuntimeError(f"the FullSweep did not finish: {summary}")
    return {
        "seconds": round(seconds, 2),
        "paused_s": round(paused[0], 2),
        "batches": res.batches,
        "posts": summary["posts_reconciled"],
        "corrected": summary["drift_corrected"],
    }


def _airflow_conn(dsn: str) -> str:
    from tools import devenv

    return devenv.airflow_connection(dsn)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.replica_lag", description=__doc__)
    ap.add_argument("--posts", type=int, default=200_000, help="posts of the data set")
    ap.add_argument("--hold", type=float, default=10.0, help="seconds the replay is stopped")
    ap.add_argument("--port", type=int, default=25432, help="the primary's port (+1: standby)")
    args = ap.parse_args(argv)
    setup_airflow_env()
    from tools import datagen, devenv
    from tools.replica import start_pair

    pair = start_pair("-bench", args.port)
    try:
        pair.primary.sql("CREATE DATABASE news_template")
        template = pair.primary.dsn("news_template")
        datagen.news(template, posts=args.posts, comments=10 * args.posts)
        devenv.run_sql_file(template, "schema/pin_nightly.sql")
        for name in ("news_steady", "news_lagging"):
            pair.primary.sql(f"CREATE DATABASE {name} TEMPLATE news_template")
        pair.wait_caught_up(timeout=600)
        steady = _run(pair.primary.dsn("news_steady"), None, pair)
        pair.wait_caught_up(timeout=600)
        lagging = _run(pair.primary.dsn("news_lagging"), args.hold, pair)
    finally:
        pair.stop()
    out = {
        "measured_at": datetime.now(UTC).isoformat(),
        "command": " ".join(["python -m bench.replica_lag", *(argv or sys.argv[1:])]),
        "posts": args.posts,
        "hold_s": args.hold,
        "lag_limit_mb": LAG_MB,
        "steady": steady,
        "lagging": lagging,
        "extra_s": round(lagging["seconds"] - steady["seconds"], 2),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "replica_lag.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
