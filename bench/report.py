"""Render the measured part of ``bench/RESULTS.md`` from every ``bench/out/results_s*.json``.

``python -m bench.report`` re-renders without measuring. The hand-written analysis above the
line ``<!-- generated -->`` of RESULTS.md is kept as it is.
"""

from __future__ import annotations

import json
import statistics

from bench.common import BENCH, OUT, pct

RESULTS_MD = BENCH / "RESULTS.md"
MARK = "<!-- generated -->"
# the longest row-lock wait a job may cause a hot-path transaction
LOCK_WAIT_LIMIT_MS = 20
NAMES = {
    "news": {
        "floor": "floor: one UPDATE of all posts",
        "full_1": "FullSweep, 1 range (1 % drift)",
        "full_2": "FullSweep, 2 ranges in parallel",
        "nodrift_1": "FullSweep, 1 range, no drift",
        "window_1": "DailyWindow, 1 range",
    },
    "catalog": {
        "floor": "floor: one INSERT .. ON CONFLICT + one UPDATE",
        "job_1": "popularity run, 1 range",
        "job_2": "popularity run, 2 ranges in parallel",
        "job_1_walc": "popularity run, 1 range, wal_compression",
        "retention": "retention (one night of snapshots)",
        "retention_walc": "retention, wal_compression",
    },
}


def load_all() -> list[dict]:
    runs = [json.loads(p.read_text()) for p in sorted(OUT.glob("results_s*.json"))]
    return sorted(runs, key=lambda r: r["scale"])


def med(runs: list[dict], key: str = "seconds"):
    vals = [r[key] for r in runs]
    return statistics.median(vals) if vals else None


def fp(runs: list[dict], key: str, agg=statistics.median):
    return agg([r["footprint"][key] for r in runs])


def f(v, nd: int = 2) -> str:
    return "-" if v is None else f"{v:,.{nd}f}" if isinstance(v, float) else f"{v:,}"


def items(res: dict, job: str) -> dict:
    return res.get(job, {}).get("items", {})


def ratio(res: dict, job: str, a: str, b: str):
    ia, ib = items(res, job).get(a), items(res, job).get(b)
    return med(ia) / med(ib) if ia and ib else None


def wal_per_card(res: dict, run: str, prune: str) -> str:
    """WAL bytes of a night (the run and its retention) per card, against the 1 kB target."""
    its = items(res, "catalog")
    if not its.get(run) or not its.get(prune):
        return "-"
    cards = res["catalog"]["meta"]["facts"]["cards"]
    per = (fp(its[run], "wal_bytes") + fp(its[prune], "wal_bytes")) / cards
    return f"{per:,.0f} bytes {met(per <= 1000)}"


def met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def targets(all_res: list[dict]) -> list[str]:
    head = "| target | limit | " + " | ".join(f"scale {r['scale']:g}" for r in all_res) + " |"
    out = [head, "|---|---|" + "---:|" * len(all_res)]

    def row(name: str, limit: str, cells: list[str]) -> None:
        out.append(f"| {name} | {limit} | " + " | ".join(cells) + " |")

    for name, limit, job, a, b, lim in (
        ("FullSweep, two ranges", "<= 0.8x floor", "news", "full_2", "floor", 0.8),
        ("FullSweep, one range", "<= 1.5x floor", "news", "full_1", "floor", 1.5),
        ("DailyWindow", "<= 0.5x FullSweep", "news", "window_1", "full_1", 0.5),
        ("popularity run, one range", "<= 1.0x floor", "catalog", "job_1", "floor", 1.0),
    ):
        xs = [ratio(res, job, a, b) for res in all_res]
        row(name, limit, ["-" if x is None else f"{x:.2f}x {met(x <= lim)}" for x in xs])
    for name, run, prune in (
        ("popularity WAL a card, retention included", "job_1", "retention"),
        ("the same, job sessions with wal_compression", "job_1_walc", "retention_walc"),
    ):
        row(name, "<= 1,000 bytes", [wal_per_card(res, run, prune) for res in all_res])
    cells = []
    for res in all_res:
        pruned = items(res, "catalog").get("retention")
        mb = pruned and fp(pruned, "wal_bytes") / 1e6
        cells.append("-" if not pruned else f"{mb:.2f} MB {met(mb <= 1)}")
    row("retention WAL a night", "<= 1 MB", cells)
    for job in ("news", "catalog"):
        ws = [res.get(job, {}).get("worker_kb") for res in all_res]
        kb = [w and max(max(v) for v in w["hwm"].values()) for w in ws]
        row(
            f"{job} worker peak RSS (VmHWM)",
            "flat",
            [f"{k / 1024:.0f} MiB" if k else "-" for k in kb],
        )
    for item, kind, job in (
        ("full_1", "news", "FullSweep"),
        ("window_1", "news", "DailyWindow"),
        ("popularity_1", "catalog", "popularity run"),
        ("full_1_paced", "news", "FullSweep, paced"),
        ("popularity_1_paced", "catalog", "popularity run, paced"),
    ):
        hps = [res.get("hotpath") for res in all_res]
        if not any(hp and item in hp["latency"] for hp in hps):
            continue  # results from before the phase existed
        cells: dict[str, list[str]] = {"idle": [], "busy_core": [], "wait": []}
        for hp in hps:
            if not hp or item not in hp["latency"]:
                for c in cells.values():
                    c.append("-")
                continue
            run = hp["latency"][item][kind]
            for base in ("idle", "busy_core"):
                ref = hp["latency"][base][kind]["p99"]
                x = run["p99"] / ref
                cells[base].append(
                    f"{x:.2f}x ({f(run['p99'], 1)} vs {f(ref, 1)} ms) {met(x <= 1.25)}"
                )
            held = pct([ms for r in hp["runs"][item] for ms in r.get("lock_ms", [])], 99)
            wait = run.get("job_lock_max", run["lock_max"])
            cells["wait"].append(
                f"{f(wait, 1)} ms (locks held p99 {f(held, 1)} ms) {met(wait < LOCK_WAIT_LIMIT_MS)}"
            )
        row(f"{kind} hot-path p99 during a {job}", "<= 1.25x idle p99", cells["idle"])
        row(
            f"{kind} hot-path p99 during a {job}",
            "<= 1.25x busy-core p99",
            cells["busy_core"],
        )
        row(
            f"longest {kind} row-lock wait on the job during a {job}",
            f"< {LOCK_WAIT_LIMIT_MS} ms",
            cells["wait"],
        )
    return out


def times(res: dict) -> list[str]:
    out = [
        "| job | measurement | min s | median s | x floor | rows | changed | s per M rows "
        "| batches | batch tx p50 / p99 ms | CPU busy |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for job, names in NAMES.items():
        its = items(res, job)
        for key, name in names.items():
            runs = its.get(key)
            if not runs:
                continue
            m, rows = med(runs), runs[0]["rows"]
            x = m / med(its["floor"]) if key != "retention" else None
            bm = [ms for r in runs for ms in r["batch_ms"]]
            out.append(
                f"| {job} | {name} | {f(min(r['seconds'] for r in runs))} | {f(m)} | "
                f"{'-' if x is None else f'{x:.2f}x'} | {f(rows)} | {f(runs[0]['changed'])} | "
                f"{f(m / rows * 1e6 if rows else None)} | {f(runs[0].get('batches', 1))} | "
                f"{f(pct(bm, 50), 1)} / {f(pct(bm, 99), 1)} | "
                f"{f(statistics.median([r['cpu_busy'] or 0 for r in runs]) * 100, 0)} % |"
            )
    return out


def growth(all_res: list[dict]) -> list[str]:
    head = "| job | measurement | " + " | ".join(
        f"s per M rows, scale {r['scale']:g}" for r in all_res
    )
    out = [head + " |", "|---|---|" + "---:|" * len(all_res)]
    for job, names in NAMES.items():
        for key, name in names.items():
            cells = []
            for res in all_res:
                runs = items(res, job).get(key)
                rows = runs[0]["rows"] if runs else 0
                cells.append(f(med(runs) / rows * 1e6) if rows else "-")
            out.append(f"| {job} | {name} | " + " | ".join(cells) + " |")
    return out


def footprint(res: dict) -> list[str]:
    out = [
        "| job | measurement | WAL MB | WAL records | full-page images | pages written "
        "| WAL bytes per row | pages per 1000 rows | checkpoints during |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for job, names in NAMES.items():
        for key, name in names.items():
            runs = items(res, job).get(key)
            if not runs or "footprint" not in runs[0]:
                continue
            rows = runs[0]["rows"] or 1
            wal, pages = fp(runs, "wal_bytes"), fp(runs, "pages_written")
            out.append(
                f"| {job} | {name} | {f(wal / 1e6)} | {f(fp(runs, 'wal_records'))} | "
                f"{f(fp(runs, 'wal_fpi'))} | {f(pages)} | {f(wal / rows, 1)} | "
                f"{f(pages / rows * 1000, 2)} | {fp(runs, 'checkpoints_during', max)} |"
            )
    return out


def hotpath(res: dict) -> list[str]:
    hp = res.get("hotpath")
    if not hp:
        return []
    out = [
        f"At {hp['rate']:g} tx/s of each kind (bench/README.md), latency from each transaction's "
        "scheduled start; *lock wait*: its longest row-lock wait from the server log (0: none "
        "longer than 5 ms), on a lock the job held / on any lock (the hot path's transactions "
        "also wait for each other on their hot rows); *row locks held*: per job transaction "
        "that held row locks, from the start of its first locking statement to the return of "
        "its COMMIT.",
        "",
        "| phase | job s (median) | job batch tx p99 ms | job row locks held p99 / max ms "
        "| news tx | news p50 / p99 / max ms "
        "| news lock wait ms, on the job / any | catalog tx | catalog p50 / p99 / max ms "
        "| catalog lock wait ms, on the job / any "
        "| failures |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for item, lat in hp["latency"].items():
        runs = hp["runs"].get(item, [])
        n, c = lat["news"], lat["catalog"]
        bm = [ms for r in runs for ms in r["batch_ms"]]
        lm = [ms for r in runs for ms in r.get("lock_ms", [])]
        held = f"{f(pct(lm, 99), 1)} / {f(max(lm), 1)}" if lm else "-"
        phase = item if runs else f"{item.replace('_', ' ')} ({hp['idle_s']} s)"
        out.append(
            f"| {phase} | {f(med(runs)) if runs else '-'} | "
            f"{f(pct(bm, 99), 1)} | {held} | {n['n']} | {f(n['p50'], 1)} / {f(n['p99'], 1)} / "
            f"{f(n['max'], 1)} | {waits(n)} | {c['n']} | {f(c['p50'], 1)} / "
            f"{f(c['p99'], 1)} / {f(c['max'], 1)} | {waits(c)} | "
            f"{n['failures'] + c['failures']} |"
        )
    return out


def waits(lat: dict) -> str:
    """The longest row-lock wait on the job's locks / on any lock (older results: any)."""
    if "job_lock_max" not in lat:
        return f(lat["lock_max"], 1)
    return f"{f(lat['job_lock_max'], 1)} / {f(lat['lock_max'], 1)}"


def statements(res: dict, job: str, key: str) -> list[str]:
    runs = items(res, job).get(key)
    if not runs or not runs[0].get("statements"):
        return []
    run = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
    out = [
        f"{NAMES[job][key]} (median repetition, {run['seconds']:.2f} s; plan "
        f"{run['plan_s']:.2f} s; timed by the driver, see bench/README.md):",
        "",
        "| statement | calls | ms per call | total s | share |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, (n, s) in sorted(run["statements"].items(), key=lambda kv: -kv[1][1])[:8]:
        share = s / run["seconds"] * 100
        out.append(f"| {name} | {n} | {s / n * 1000:.2f} | {s:.2f} | {share:.0f} % |")
    return out


def facts(res: dict) -> list[str]:
    fa = res["facts"]
    data = []
    if "news" in res:
        nf = res["news"]["meta"]["facts"]
        data.append(
            f"News: {f(nf['posts'])} posts ({f(nf['archived'])} archived), {f(nf['comments'])} "
            f"comments, {f(nf['drifted'])} drifted counters; {res['news']['meta']['db_size']}."
        )
    if "catalog" in res:
        cf = res["catalog"]["meta"]["facts"]
        data.append(
            f"Catalog: {f(cf['property_object_cards'] + cf['project_cards'])} cards, "
            f"{f(cf['snapshots'])} snapshots; {res['catalog']['meta']['db_size']}."
        )
    return [
        f"Run {res['started_at'][:16]} UTC, {res['reps']} repetitions, {res['total_s']:.0f} s; "
        f"`{res['command']}`; job code at `{res['code']['head']}`"
        + (f" (modified: {', '.join(res['code']['modified'])})" if res["code"]["modified"] else "")
        + ".",
        f"{fa['cpu_count']} cores ({fa['cpu_model']}), {fa['ram_gib']} GiB; PostgreSQL "
        f"{fa['postgresql']} (embedded), shared_buffers {fa['pg_shared_buffers']}.",
        " ".join(data),
    ]


def replica_lag() -> list[str]:
    """The pause of a FullSweep while a replica lags (bench/replica_lag.py), if measured."""
    path = OUT / "replica_lag.json"
    if not path.exists():
        return []
    r = json.loads(path.read_text())
    steady, lagging = r["steady"], r["lagging"]
    return [
        "## Pacing on a lagging replica",
        "",
        f"`{r['command'].strip()}`, {r['measured_at'][:16].replace('T', ' ')} UTC: a one-range "
        f"FullSweep of {r['posts']:,} posts, replica-lag limit {r['lag_limit_mb']} MB, the "
        f"standby's replay stopped for {r['hold_s']:g} s after the first batch.",
        "",
        "| run | seconds | paused s | batches | posts | corrected |",
        "|---|---:|---:|---:|---:|---:|",
        *(
            f"| {name} | {x['seconds']} | {x['paused_s']} | {x['batches']} | {x['posts']} | "
            f"{x['corrected']} |"
            for name, x in (("no lag", steady), ("replica lagging", lagging))
        ),
        "",
        f"The lag added {r['extra_s']} s to the run: the pause lasts until the first recheck "
        "after the standby has replayed back under the limit (rechecks after 0.5, 1 and 2 s, then "
        "every 4 s). "
        "tests/test_pacing.py proves that no batch is written meanwhile.",
    ]


def render(all_res: list[dict]) -> str:
    out = ["## Targets", "", *targets(all_res), "", "## Growth", "", *growth(all_res), ""]
    if lag := replica_lag():
        out += [*lag, ""]
    for res in reversed(all_res):
        out += [f"## Scale {res['scale']:g}", "", *facts(res), ""]
        out += ["### Times", "", *times(res), "", "### Write footprint", ""]
        out += [
            "Per run, from `pg_stat_wal` (WAL) and `pg_stat_bgwriter` (8 kB pages written "
            "during the run and by the CHECKPOINT after it); a CHECKPOINT precedes every "
            "measured run. Medians.",
            "",
            *footprint(res),
            "",
        ]
        if res.get("hotpath"):
            out += ["### Hot path", "", *hotpath(res), ""]
        out += ["### Per statement", ""]
        for job, key in (("news", "full_1"), ("news", "window_1"), ("catalog", "job_1")):
            out += [*statements(res, job, key), ""]
    return "\n".join(out)


def write():
    old = RESULTS_MD.read_text() if RESULTS_MD.exists() else ""
    head = old.split(MARK)[0] if MARK in old else "# Benchmark results\n\n"
    RESULTS_MD.write_text(head + MARK + "\n\n" + render(load_all()) + "\n")
    return RESULTS_MD


if __name__ == "__main__":
    print(write())
