"""Benchmark of both jobs: ``python -m bench.run --scale 0.1``.

On one data set per scale, reset between measurements, the measurements interleaved per
repetition: the set-based floor, the job code with one and two ranges, a FullSweep that finds no
drift, the DailyWindow, retention; each with its write footprint. Then the hot-path load at a
fixed rate: idle, with one core busy, and during a FullSweep, a DailyWindow and a popularity
run. Results go to ``bench/out/results_s<scale>.json``; ``bench/RESULTS.md`` is rendered from
every results file.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from datetime import UTC, datetime

import psycopg

from bench import data, runners
from bench.common import (
    OUT,
    busy_between,
    code_version,
    cpu_sample,
    db_name,
    dump_json,
    machine_facts,
    pct,
    scale_tag,
    setup_airflow_env,
    wait_quiet,
)
from pin_nightly.db import WAL_COMPRESSION

log = logging.getLogger("bench")
# Checkpoints where the bench puts them (a CHECKPOINT before each measured run), not in the
# middle of a run that writes more than the default max_wal_size of 1 GB.
SERVER = {"max_wal_size": "32GB", "checkpoint_timeout": "1h"}
IDLE_S = 20
QUIET_WAIT = [60.0]  # seconds at most to wait for a quiet machine (--quiet-wait)


def measure(fn, dsn: str) -> dict:
    """Wait for a quiet machine, run one measurement with its footprint, note the CPU use."""
    gate = wait_quiet(max_wait=QUIET_WAIT[0])
    probe = runners.Footprint(dsn)
    try:
        probe.start()
        before = cpu_sample()
        r = fn()
        r["cpu_busy"] = busy_between(before, cpu_sample())
        r["footprint"] = probe.stop()
    finally:
        probe.close()
    r["gate"] = gate
    return r


def _log(job: str, item: str, rep: int, r: dict) -> None:
    fp, p99 = r.get("footprint", {}), pct(r.get("batch_ms") or [0], 99)
    log.info(
        f"{job} {item:<9} rep {rep + 1}: {r['seconds']:7.2f} s rows={r['rows']} "
        f"changed={r['changed']} batch p99={p99:.1f} ms "
        f"WAL={fp.get('wal_bytes', 0) / 1e6:.1f} MB pages={fp.get('pages_written')}"
    )


def _warm_up(conn_id: str) -> None:
    """Import what the first hook connection and the metrics facade import (not timed)."""
    from pin_nightly import db, metrics

    with db.connection(conn_id):
        pass
    metrics.gauge(f"{metrics.NEWS}_drift_alert_threshold", 0)


def bench_job(args, job: str, dsn: str, pools: dict) -> dict:
    """The floor and the job's runs, interleaved per repetition, each from reset data. A run
    that writes something other than the floor fails (a DailyWindow: than its first run)."""

    def exact_first() -> None:  # the counters made exact before the run (not measured)
        runners.floor(dsn, "news")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("VACUUM news.posts")

    plan = {  # item: (preparation, measured run)
        "news": {
            "floor": (None, lambda: runners.floor(dsn, job)),
            "full_1": (None, lambda: runners.run_news(pools[1], "FullSweep", 1)),
            "full_2": (None, lambda: runners.run_news(pools[2], "FullSweep", 2)),
            "nodrift_1": (exact_first, lambda: runners.run_news(pools[1], "FullSweep", 1)),
            "window_1": (None, lambda: runners.run_news(pools[1], "DailyWindow", 1)),
        },
        "catalog": {
            "floor": (None, lambda: runners.floor(dsn, job)),
            "job_1": (None, lambda: runners.run_catalog(pools[1], 1)),
            "job_2": (None, lambda: runners.run_catalog(pools[2], 2)),
            "job_1_walc": (None, lambda: runners.run_catalog(pools["walc"], 1)),
        },
    }[job]
    items: dict[str, list] = {k: [] for k in plan}
    refs: dict = {}
    for rep in range(args.reps):
        for item, (prepare, fn) in plan.items():
            if job == "news":
                data.reage_news(dsn)
                data.reset_news(dsn)
            else:
                data.reset_catalog(dsn)
            if prepare:
                prepare()
            r = measure(fn, dsn)
            if job == "news":
                check = data.news_checksum(dsn, full=rep == 0 and item in ("floor", "full_1"))
                if check.pop("drift_left"):
                    raise RuntimeError(f"news {item} left drift")
            else:
                check = data.catalog_checksum(dsn)
            ref = refs.setdefault("window" if item == "window_1" else "all", check)
            if check != ref:
                raise RuntimeError(f"{job} {item} wrote something else: {check} vs {ref}")
            r["rep"] = rep
            items[item].append(r)
            _log(job, item, rep, r)
    return items


def bench_retention(dsn: str) -> dict[str, list[dict]]:
    """Retention of the oldest night, at the end, without and with wal_compression (the reset
    before each puts the night back as a partition of its own)."""
    out = {}
    for item, walc in (("retention", "off"), ("retention_walc", WAL_COMPRESSION)):
        data.reset_catalog(dsn)
        r = measure(lambda walc=walc: runners.run_retention(walc), dsn)
        if not r["rows"]:
            raise RuntimeError("retention pruned nothing")
        _log("catalog", item, 0, r)
        out[item] = [r]
    return out


def bench_hotpath(args, dsns: dict, pools: dict) -> dict:
    """The hot-path load idle, with one core taken by a busy loop that touches no database (the
    CPU a job's worker and backend take, without their locks and I/O), both once, and during
    one-range runs (one pool slot, the default) in each repetition: with pacing off, as every
    speed measurement runs, and with the DAGs' default pacing limits (``*_paced``)."""

    def busy_core() -> None:
        loop = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
        time.sleep(IDLE_S)
        loop.kill()
        loop.wait()

    phases = {
        "idle": (None, lambda: time.sleep(IDLE_S)),
        "busy_core": (None, busy_core),
        "full_1": ("news", lambda: runners.run_news(pools["news"][1], "FullSweep", 1)),
        "window_1": ("news", lambda: runners.run_news(pools["news"][1], "DailyWindow", 1)),
        "popularity_1": ("catalog", lambda: runners.run_catalog(pools["catalog"][1], 1)),
        # the same runs pacing on the database's health with the DAGs' default limits
        "full_1_paced": (
            "news",
            lambda: runners.run_news(pools["news"][1], "FullSweep", 1, paced=True),
        ),
        "popularity_1_paced": (
            "catalog",
            lambda: runners.run_catalog(pools["catalog"][1], 1, paced=True),
        ),
    }
    data.reset_catalog(dsns["catalog"])  # keeps the pristine counters the phases restore
    windows: dict[str, list] = {k: [] for k in phases}
    statements: dict[str, list] = {k: [] for k in phases}  # per command of the scripts, avg ms
    runs: dict[str, list] = {k: [] for k, (job, _) in phases.items() if job}
    gates = []
    for rep in range(args.reps):
        for item, (job, fn) in phases.items():
            if job is None and rep:
                continue
            if job == "news":
                data.reage_news(dsns["news"])
                data.reset_news(dsns["news"])
            elif job:
                data.reset_catalog(dsns["catalog"])
            hp = runners.HotPath(dsns, args.rate)
            gates.append(wait_quiet(max_wait=QUIET_WAIT[0]))
            with hp:
                t0 = time.time()
                r = fn()
                t1 = time.time()
            for kind, res in hp.results.items():
                if res.failures:
                    log.warning("hot path %s during %s: %s", kind, item, res.failures[:3])
            recs = {k: (res.between(t0, t1), res.aborted) for k, res in hp.results.items()}
            windows[item].append((recs, hp.lock_waits))
            statements[item].append({k: res.statements for k, res in hp.results.items()})
            if job:
                keys = ("seconds", "rows", "changed", "batch_ms", "lock_ms")
                runs[item].append({k: r[k] for k in keys})
                log.info("hot path during %s rep %d: %.1f s", item, rep + 1, r["seconds"])
            data.reset_news(dsns["news"], hotpath_since=hp.started)
            data.restore_views(dsns["catalog"])
    data.reset_catalog(dsns["catalog"], views=True)
    out = {"rate": args.rate, "idle_s": IDLE_S, "latency": {}, "runs": runs, "gates": gates}
    out["statements"] = statements
    for item, ws in windows.items():
        out["latency"][item] = {
            kind: runners.latency(
                [x for recs, _ in ws for x in recs[kind][0]],
                [ms for _, w in ws for ms in w[kind]],
                sum(recs[kind][1] for recs, _ in ws),
            )
            for kind in ("news", "catalog")
        }
        log.info("hot path %s: %s", item, out["latency"][item])
    return out


# news FullSweep batch sizes against the adaptive one: item -> (batch_size, batch_target_ms)
BATCH_CONFIGS = {
    "static_500": (500, 0),
    "static_2000": (2000, 0),
    "static_8000": (8000, 0),
    "adaptive_200ms": (2000, 200),
}


def bench_batch_sizes(args, dsns: dict, pools: dict) -> dict:
    """A news FullSweep in one range with the hot path on, at static batch sizes and with an
    adaptive one (``batch_target_ms``): the run's rows a second and the hot path's latency."""
    out: dict[str, list] = {k: [] for k in BATCH_CONFIGS}
    for rep in range(args.reps):
        for item, (size, target) in BATCH_CONFIGS.items():
            data.reage_news(dsns["news"])
            data.reset_news(dsns["news"])
            hp = runners.HotPath({"news": dsns["news"]}, args.rate)
            gate = wait_quiet(max_wait=QUIET_WAIT[0])
            extra = {"batch_size": size, "batch_target_ms": target}
            with hp:
                t0 = time.time()
                r = runners.run_news(pools["news"][1], "FullSweep", 1, extra=extra)
                t1 = time.time()
            res = hp.results["news"]
            lat = runners.latency(res.between(t0, t1), hp.lock_waits["news"], res.aborted)
            batches = r["batch_ms"]
            out[item].append(
                {"rep": rep, "gate": gate, "seconds": r["seconds"], "rows": r["rows"]}
                | {"rows_per_s": r["rows"] / r["seconds"], "batches": len(batches)}
                | {"batch_ms_p50": pct(batches, 50), "batch_ms_max": max(batches, default=0)}
                | {"hot_p50": lat["p50"], "hot_p99": lat["p99"]}
                | {"job_lock_max": lat["job_lock_max"]}
            )
            log.info("batch size %s rep %d: %s", item, rep + 1, out[item][-1])
            data.reset_news(dsns["news"], hotpath_since=hp.started)
    return out


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="1 = 1M posts / 305k cards")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each measurement")
    ap.add_argument(
        "--jobs", default="news,catalog,hotpath", help="what to measure (also: batchsize)"
    )
    ap.add_argument("--rate", type=float, default=100, help="hot-path tx/s of each kind")
    ap.add_argument("--quiet-wait", type=float, default=60, help="max s to wait for idle CPUs")
    ap.add_argument("--regenerate", action="store_true", help="regenerate the data sets")
    ap.add_argument("--no-report", action="store_true", help="do not rewrite bench/RESULTS.md")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    QUIET_WAIT[0] = args.quiet_wait
    setup_airflow_env()
    handler = logging.StreamHandler(sys.stdout)  # Airflow reconfigures the root logger
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    from tools import devenv

    t0 = time.monotonic()
    results = {
        "scale": args.scale,
        "reps": args.reps,
        "started_at": datetime.now(UTC).isoformat(),
        "command": "python -m bench.run " + " ".join(argv if argv is not None else sys.argv[1:]),
        "facts": machine_facts(devenv.admin_dsn()),
        "code": code_version(),
    }
    jobs = args.jobs.split(",")
    with psycopg.connect(devenv.admin_dsn(), autocommit=True) as conn:
        for name, value in SERVER.items():
            conn.execute(f"ALTER SYSTEM SET {name} = '{value}'")
        conn.execute("SELECT pg_reload_conf()")
    # the data sets measured: the hot path uses both databases
    needed = [j for j in ("news", "catalog") if j in jobs or "hotpath" in jobs]
    if "batchsize" in jobs and "news" not in needed:
        needed.append("news")
    ensure = {"news": data.ensure_news, "catalog": data.ensure_catalog}
    meta = {job: ensure[job](args.scale, args.regenerate) for job in needed}
    dsns = {job: devenv.dsn_for(db_name(job, args.scale)) for job in needed}
    tag = scale_tag(args.scale)
    pools = {}
    for job, conn_id in (("news", "news_db"), ("catalog", "catalog_db")):
        if job not in needed:
            continue
        os.environ[f"AIRFLOW_CONN_{conn_id.upper()}"] = devenv.airflow_connection(dsns[job])
        _warm_up(conn_id)
        pools[job] = {n: runners.Pool(n, dsns[job], f"{job}-s{tag}") for n in (1, 2)}
        if job == "catalog" and "catalog" in jobs:  # the job's sessions with wal_compression
            walc = {"PIN_WAL_COMPRESSION": WAL_COMPRESSION}
            pools[job]["walc"] = runners.Pool(1, dsns[job], f"{job}-s{tag}", walc)
        results[job] = {"meta": meta[job]}
    path = OUT / f"results_s{tag}.json"
    try:
        for job in ("news", "catalog"):
            if job in jobs:
                results[job]["items"] = bench_job(args, job, dsns[job], pools[job])
                dump_json(path, results)
        if "hotpath" in jobs:
            results["hotpath"] = bench_hotpath(args, dsns, pools)
            dump_json(path, results)
        if "batchsize" in jobs:
            results["batchsize"] = bench_batch_sizes(args, dsns, pools)
            dump_json(path, results)
        if "catalog" in jobs:
            results["catalog"]["items"].update(bench_retention(dsns["catalog"]))
    finally:
        for job in pools:
            ready = [w.ready["rss_kb"] for p in pools[job].values() for w in p.workers]
            final = {n: [f["hwm_kb"] for f in p.close()] for n, p in pools[job].items()}
            results[job]["worker_kb"] = {"ready": max(ready), "hwm": final}
    results["total_s"] = round(time.monotonic() - t0, 1)
    dump_json(path, results)
    log.info("results in %s (%.0f s)", path, results["total_s"])
    if not args.no_report:
        from bench import report

        log.info("wrote %s", report.write())
    return 0


if __name__ == "__main__":
    sys.exit(main())
