"""Benchmark of both jobs against their set-based floors: ``python -m bench.run --scale 0.1``.

For each job, on one data set generated once per scale and reset between repetitions:
the floor (one set-based statement), the job code with one range and with two ranges in
parallel, the news DailyWindow against the FullSweep, one whole DAG run through Airflow, the
EXPLAIN ANALYZE of the per-batch statements, and optionally scratch variants of the job code
(``--variants``). Results go to ``bench/out/results_s<scale>.json``; ``bench/RESULTS.md`` is
rendered from every results file present (so runs at 0.1 and 1 end up side by side).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import time
from datetime import UTC, datetime, timedelta
from datetime import time as dtime

from bench.common import (
    AS_OF,
    OUT,
    catalog_db,
    code_version,
    dump_json,
    loadavg,
    machine_facts,
    news_db,
    scale_tag,
    setup_airflow_env,
)

log = logging.getLogger("bench")

NEWS_ITEMS = ("floor", "full_1", "full_2", "window_1", "window_floor")
CATALOG_ITEMS = ("floor", "job_1", "job_2")


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiplies the data volumes (1 = 1M posts / 10M comments / 305k cards)",
    )
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each measurement")
    ap.add_argument("--jobs", default="news,catalog", help="news,catalog (default both)")
    ap.add_argument("--regenerate", action="store_true", help="regenerate the data sets")
    ap.add_argument("--skip-dag", action="store_true", help="no DAG run through Airflow")
    ap.add_argument("--skip-explain", action="store_true", help="no EXPLAIN ANALYZE")
    ap.add_argument(
        "--variants",
        default="",
        help="comma-separated scratch variants to measure too (bench/variants.py), or 'all'",
    )
    ap.add_argument("--variant-reps", type=int, default=3)
    ap.add_argument(
        "--variant-ranges",
        type=int,
        default=1,
        help="ranges (worker processes in parallel) of the variant runs",
    )
    ap.add_argument(
        "--variants-only",
        action="store_true",
        help="measure only the variants (and a floor for the reference results) "
        "and replace the variants section of the results of this scale",
    )
    ap.add_argument("--no-report", action="store_true", help="do not rewrite bench/RESULTS.md")
    return ap.parse_args(argv)


def _summ(r: dict) -> str:
    from bench.common import pct

    lock = r.get("lock_ms") or []
    return (
        f"{r['seconds']:8.2f} s  rows={r['rows']} changed={r['changed']} "
        f"lock p50={pct(lock, 50) or 0:.1f} p99={pct(lock, 99) or 0:.1f} ms"
    )


def _strip(r: dict) -> dict:
    """Keep the per-batch lock times (for percentiles) but not the log cross-check list."""
    out = dict(r)
    lm = out.pop("lock_ms_log", None)
    if lm is not None and r.get("lock_ms"):
        from bench.common import pct

        out["lock_ms_log_p50"] = pct(lm, 50)
        out["lock_ms_log_p99"] = pct(lm, 99)
    return out


def measure(fn, *a, **kw) -> dict:
    """Wait for a quiet machine, run one measurement, note how busy the machine was."""
    from bench.common import busy_between, cpu_sample, wait_quiet

    gate = wait_quiet()
    before = cpu_sample()
    r = fn(*a, **kw)
    r["cpu_busy"] = busy_between(before, cpu_sample())
    r["gate"] = gate
    return r


def bench_news(args, results: dict) -> None:
    from bench import generate, runners, variants
    from tools import devenv

    meta = generate.ensure_news(args.scale, args.regenerate)
    dsn = devenv.dsn_for(news_db(args.scale))
    generate.reage_news(dsn)
    os.environ["AIRFLOW_CONN_NEWS_DB"] = devenv.airflow_connection(dsn)
    runners.warm_up("news_db")
    base = variants.get("baseline")
    tag = f"news-s{scale_tag(args.scale)}"
    pool1 = runners.WorkerPool(1, dsn, "baseline", tag)
    pool2 = runners.WorkerPool(2, dsn, "baseline", tag)
    ready_rss = [w.ready["rss_kb"] for w in pool1.workers + pool2.workers]
    items: dict[str, list] = {k: [] for k in NEWS_ITEMS}
    sums: dict[str, dict] = {}
    resets = []
    for rep in range(args.reps):
        for item in NEWS_ITEMS:
            generate.reage_news(dsn)
            resets.append(generate.reset_news(dsn))
            if item == "floor":
                r = measure(runners.news_floor, dsn)
            elif item == "window_floor":
                r = measure(runners.news_floor, dsn, datetime.now(UTC) - timedelta(hours=26))
            elif item == "full_1":
                r = measure(runners.run_news_job, pool1, "FullSweep", 1, base)
            elif item == "full_2":
                r = measure(runners.run_news_job, pool2, "FullSweep", 2, base)
            else:
                r = measure(runners.run_news_job, pool1, "DailyWindow", 1, base)
            if rep == 0 and item in ("floor", "full_1"):
                r["checksum"] = generate.news_checksum(dsn)
                if r["checksum"]["drift_left"] != 0:
                    raise RuntimeError(f"news {item} left drift: {r['checksum']}")
            else:
                r["checksum"] = generate.news_light_checksum(dsn)
            key = "window" if item.startswith("window") else "full"
            light = {k: r["checksum"][k] for k in ("sum", "hash")}
            if key in sums and sums[key] != light:
                raise RuntimeError(
                    f"news {item}: result differs from the other runs: {light} vs {sums[key]}"
                )
            sums.setdefault(key, light)
            r["rep"] = rep
            items[item].append(_strip(r))
            log.info("news %-13s rep %d: %s", item, rep + 1, _summ(r))
    final = {"pool1": pool1.close(), "pool2": pool2.close()}
    results["news"] = {
        "meta": meta,
        "items": items,
        "reset_s": resets,
        "worker_ready_rss_kb": ready_rss,
        "worker_final": final,
        "worker_hwm_kb_1range": max(f["hwm_kb"] for f in final["pool1"]),
        "worker_hwm_kb_2ranges": max(f["hwm_kb"] for f in final["pool2"]),
    }
    if not args.skip_explain:
        from bench import explain

        generate.reset_news(dsn)
        results["news"]["explain"] = explain.explain_news(dsn, args.scale)
    if args.variants:
        results["news"]["variants"] = run_variants(args, "news", dsn, sums)
    if not args.skip_dag:
        generate.reset_news(dsn)
        logical = datetime.now(UTC).replace(microsecond=0)
        conf = {"scope": "FullSweep", **runners.BIG_BUDGET, "drift_alert_threshold": 10**9}
        r = runners.run_dag_subprocess(
            "news_comment_reconcile",
            conf,
            logical,
            {"AIRFLOW_CONN_NEWS_DB": os.environ["AIRFLOW_CONN_NEWS_DB"]},
            tag,
        )
        r["checksum"] = generate.news_light_checksum(dsn)
        r["conf"] = conf
        results["news"]["dag"] = r
        log.info(
            "news DAG run: %.1f s, state %s, summary %s", r["wall_s"], r["state"], r["summary"]
        )


def bench_catalog(args, results: dict) -> None:
    from bench import generate, runners, variants
    from tools import devenv

    meta = generate.ensure_catalog(args.scale, args.regenerate)
    dsn = devenv.dsn_for(catalog_db(args.scale))
    os.environ["AIRFLOW_CONN_CATALOG_DB"] = devenv.airflow_connection(dsn)
    runners.warm_up("catalog_db")
    base = variants.get("baseline")
    tag = f"catalog-s{scale_tag(args.scale)}"
    pool1 = runners.WorkerPool(1, dsn, "baseline", tag)
    pool2 = runners.WorkerPool(2, dsn, "baseline", tag)
    ready_rss = [w.ready["rss_kb"] for w in pool1.workers + pool2.workers]
    items: dict[str, list] = {k: [] for k in CATALOG_ITEMS}
    ref = None
    resets = []
    for rep in range(args.reps):
        for item in CATALOG_ITEMS:
            resets.append(generate.reset_catalog(dsn))
            if item == "floor":
                r = measure(runners.catalog_floor, dsn)
            elif item == "job_1":
                r = measure(runners.run_catalog_job, pool1, 1, base)
            else:
                r = measure(runners.run_catalog_job, pool2, 2, base)
            r["checksum"] = generate.catalog_checksum(dsn)
            if ref is not None and r["checksum"] != ref:
                raise RuntimeError(f"catalog {item}: result differs: {r['checksum']} vs {ref}")
            ref = ref or r["checksum"]
            r["rep"] = rep
            items[item].append(_strip(r))
            log.info("catalog %-8s rep %d: %s", item, rep + 1, _summ(r))
    final = {"pool1": pool1.close(), "pool2": pool2.close()}
    results["catalog"] = {
        "meta": meta,
        "items": items,
        "reset_s": resets,
        "worker_ready_rss_kb": ready_rss,
        "worker_final": final,
        "worker_hwm_kb_1range": max(f["hwm_kb"] for f in final["pool1"]),
        "worker_hwm_kb_2ranges": max(f["hwm_kb"] for f in final["pool2"]),
    }
    if not args.skip_explain:
        from bench import explain

        generate.reset_catalog(dsn)
        results["catalog"]["explain"] = explain.explain_catalog(dsn, args.scale)
    if args.variants:
        results["catalog"]["variants"] = run_variants(args, "catalog", dsn, {"full": ref})
    if not args.skip_dag:
        generate.reset_catalog(dsn)
        logical = datetime.combine(AS_OF, dtime(3, 0), tzinfo=UTC) + timedelta(
            seconds=int(time.time()) % 18000
        )
        conf = dict(runners.BIG_BUDGET)
        r = runners.run_dag_subprocess(
            "catalog_popularity_recompute",
            conf,
            logical,
            {"AIRFLOW_CONN_CATALOG_DB": os.environ["AIRFLOW_CONN_CATALOG_DB"]},
            tag,
        )
        r["checksum"] = generate.catalog_checksum(dsn)
        r["conf"] = conf
        if r["checksum"] != ref:
            log.warning(
                "catalog DAG run result differs from the job runs: %s vs %s", r["checksum"], ref
            )
        results["catalog"]["dag"] = r
        log.info("catalog DAG run: %.1f s, state %s", r["wall_s"], r["state"])


def _ddl(dsn: str, statements) -> None:
    import psycopg

    if statements:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for stmt in statements:
                conn.execute(stmt)


def run_variants(args, job: str, dsn: str, reference: dict) -> dict:
    """Scratch variants of the job code, one range: news FullSweep and DailyWindow, and the
    popularity run. ``reference``: the checksums of the baseline runs ("full", "window")."""
    from bench import generate, runners, variants

    names = list(variants.VARIANTS) if args.variants == "all" else args.variants.split(",")
    out: dict[str, dict] = {}
    for name in names:
        v = variants.get(name)
        texts = {**v.sql, **v.sql_full_sweep}
        other = "catalog/" if job == "news" else "news/"
        if texts and all(k.startswith(other) for k in texts):
            continue  # a variant of the other job
        if (
            job == "news"
            and not texts
            and not v.session
            and name != "baseline"
            and "news" not in v.batch_size
            and v.prepare_threshold == "default"
        ):
            continue
        if (
            job == "catalog"
            and not texts
            and not v.session
            and name != "baseline"
            and "catalog" not in v.batch_size
            and v.prepare_threshold == "default"
        ):
            continue
        if v.db_setup or v.db_teardown:
            if job != "catalog" or not any(k.startswith("catalog/") for k in v.sql):
                continue
        _ddl(dsn, v.db_setup)
        nr = args.variant_ranges
        pool = runners.WorkerPool(nr, dsn, name, f"{job}-s{scale_tag(args.scale)}-{name}")
        runs, wruns = [], []
        for rep in range(args.variant_reps):
            kinds = (
                (("full", "FullSweep"), ("window", "DailyWindow"))
                if job == "news"
                else (("full", None),)
            )
            for key, scope in kinds:
                if job == "news":
                    generate.reage_news(dsn)
                    generate.reset_news(dsn)
                    r = measure(runners.run_news_job, pool, scope, nr, v)
                    check = generate.news_light_checksum(dsn)
                else:
                    generate.reset_catalog(dsn)
                    r = measure(runners.run_catalog_job, pool, nr, v)
                    check = generate.catalog_checksum(dsn)
                ref = reference.get(key)
                same = ref is None or check == ref
                r["same_result"] = same
                if not same:
                    log.warning("variant %s changes the result: %s vs %s", name, check, ref)
                r["rep"] = rep
                (runs if key == "full" else wruns).append(_strip(r))
                log.info(
                    "%s variant %-18s %-6s rep %d: %s%s",
                    job,
                    name,
                    key,
                    rep + 1,
                    _summ(r),
                    "" if same else "  RESULT DIFFERS",
                )
        fin = pool.close()
        _ddl(dsn, v.db_teardown)
        out[name if nr == 1 else f"{name}@{nr}"] = {
            "description": v.description + ("" if nr == 1 else f" -- {nr} ranges in parallel"),
            "runs": runs,
            "window_runs": wruns,
            "ranges": nr,
            "hwm_kb": max(f["hwm_kb"] for f in fin),
        }
    return out


def variants_only(args, results: dict, jobs: list[str]) -> None:
    from bench import generate, runners
    from tools import devenv

    if "news" in jobs:
        generate.ensure_news(args.scale)
        dsn = devenv.dsn_for(news_db(args.scale))
        generate.reage_news(dsn)
        os.environ["AIRFLOW_CONN_NEWS_DB"] = devenv.airflow_connection(dsn)
        runners.warm_up("news_db")
        generate.reset_news(dsn)
        runners.news_floor(dsn)
        full = generate.news_light_checksum(dsn)
        generate.reset_news(dsn)
        runners.news_floor(dsn, datetime.now(UTC) - timedelta(hours=26))
        window = generate.news_light_checksum(dsn)
        sec = results.setdefault("news", {})
        sec["variants"] = {
            **sec.get("variants", {}),
            **run_variants(args, "news", dsn, {"full": full, "window": window}),
        }
    if "catalog" in jobs:
        generate.ensure_catalog(args.scale)
        dsn = devenv.dsn_for(catalog_db(args.scale))
        os.environ["AIRFLOW_CONN_CATALOG_DB"] = devenv.airflow_connection(dsn)
        runners.warm_up("catalog_db")
        generate.reset_catalog(dsn)
        runners.catalog_floor(dsn)
        ref = generate.catalog_checksum(dsn)
        sec = results.setdefault("catalog", {})
        sec["variants"] = {
            **sec.get("variants", {}),
            **run_variants(args, "catalog", dsn, {"full": ref}),
        }


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    setup_airflow_env()
    # Airflow reconfigures the root logger when it is imported: the benchmark's own logger
    # keeps a handler of its own.
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
    blog = logging.getLogger("bench")
    blog.addHandler(handler)
    blog.setLevel(logging.INFO)
    blog.propagate = False
    from tools import devenv

    started = datetime.now(UTC)
    t0 = time.monotonic()
    admin = devenv.admin_dsn()
    results = {
        "scale": args.scale,
        "reps": args.reps,
        "started_at": started.isoformat(),
        "command": "python -m bench.run "
        + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "facts": machine_facts(admin),
        "loadavg_start": loadavg(),
        "code": code_version(),
    }
    log.info("bench at scale %g, %d repetitions; %s", args.scale, args.reps, results["facts"])
    path = OUT / f"results_s{scale_tag(args.scale)}.json"
    jobs = [j.strip() for j in args.jobs.split(",") if j.strip()]
    if args.variants_only:
        import json

        if not args.variants:
            raise SystemExit("--variants-only needs --variants")
        if not path.exists():
            raise SystemExit(f"--variants-only needs an earlier full run at this scale ({path})")
        earlier = json.loads(path.read_text())
        variants_only(args, earlier, jobs)
        earlier["variants_command"] = results["command"]
        earlier["variants_code"] = results["code"]
        earlier["variants_run_at"] = started.isoformat()
        dump_json(path, earlier)
        if not args.no_report:
            from bench import report

            log.info("wrote %s", report.write())
        return 0
    if path.exists():  # keep the other job's section of an earlier run at this scale
        import json

        earlier = json.loads(path.read_text())
        for job in ("news", "catalog"):
            if job not in jobs and job in earlier:
                results[job] = {**earlier[job], "from_run_started_at": earlier["started_at"]}
    if "news" in jobs:
        bench_news(args, results)
        dump_json(path, results)
    if "catalog" in jobs:
        bench_catalog(args, results)
    results["loadavg_end"] = loadavg()
    results["total_s"] = round(time.monotonic() - t0, 1)
    dump_json(path, results)
    log.info("results in %s (%.0f s)", path, results["total_s"])
    if not args.no_report:
        from bench import report

        md = report.write()
        log.info("wrote %s", md)
        print(report.console_summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
