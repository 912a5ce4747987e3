"""Render ``bench/RESULTS.md`` from every ``bench/out/results_s*.json`` present.

``python -m bench.report`` re-renders without measuring. The hand-written analysis in
``bench/findings.md`` (if present) is appended as it is.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.common import BENCH, OUT, median, pct

RESULTS_MD = BENCH / "RESULTS.md"
FINDINGS_MD = BENCH / "findings.md"

TARGETS = {
    "full_1": ("FullSweep, one range", "<= 2x floor"),
    "full_2": ("FullSweep, two ranges in parallel", "<= 1.25x floor"),
    "window": ("DailyWindow (1 % changed) vs FullSweep", "<= 0.6x FullSweep"),
    "popularity": ("popularity run (one range)", "<= 1.1x floor"),
    "dag_news": ("news DAG run adds to the job time", "<= 30 s"),
    "dag_catalog": ("popularity DAG run adds to the job time", "<= 30 s"),
    "rss": ("worker peak RSS, 10 % vs 100 % scale", "within 10 %"),
}


def load_all() -> list[dict]:
    out = []
    for p in sorted(OUT.glob("results_s*.json")):
        try:
            out.append(json.loads(p.read_text()))
        except ValueError:
            continue
    return sorted(out, key=lambda r: r["scale"])


def _secs(runs: list[dict]) -> list[float]:
    return [r["seconds"] for r in runs]


def _med(runs: list[dict]) -> float | None:
    return median(_secs(runs)) if runs else None


def _f(v, nd=2, unit="") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{nd}f}{unit}"
    return f"{v:,}{unit}"


def _mb(kb) -> str:
    return "-" if not kb else f"{kb / 1024:,.0f} MiB"


def evaluate(res: dict, all_results: list[dict] | None = None) -> list[dict]:
    """Each target: measured value, met or not, and why."""
    out = []
    news = res.get("news", {}).get("items", {})
    cat = res.get("catalog", {}).get("items", {})

    def add(key, value, limit, met, reason):
        name, target = TARGETS[key]
        out.append(
            {
                "key": key,
                "name": name,
                "target": target,
                "measured": value,
                "met": met,
                "reason": reason,
            }
        )

    floor = _med(news.get("floor", []))
    f1, f2, w1 = (_med(news.get(k, [])) for k in ("full_1", "full_2", "window_1"))
    if floor and f1:
        r = f1 / floor
        add(
            "full_1",
            f"{r:.2f}x ({f1:.1f} s vs {floor:.1f} s)",
            2,
            r <= 2,
            _why_full(res, "full_1", r, 2),
        )
    if floor and f2:
        r = f2 / floor
        add(
            "full_2",
            f"{r:.2f}x ({f2:.1f} s vs {floor:.1f} s)",
            1.25,
            r <= 1.25,
            _why_full(res, "full_2", r, 1.25),
        )
    if f1 and w1:
        r = w1 / f1
        wf = _med(news.get("window_floor", []))
        extra = f"; the window as one statement takes {wf:.1f} s" if wf else ""
        rows_w = news["window_1"][0]["rows"]
        rows_f = news["full_1"][0]["rows"]
        add(
            "window",
            f"{r:.2f}x ({w1:.1f} s vs {f1:.1f} s)",
            0.6,
            r <= 0.6,
            f"the window rechecks {rows_w:,} posts ({rows_w / rows_f:.0%} of the "
            f"{rows_f:,} of a full sweep), but they are the posts with comment activity, "
            f"i.e. the ones with the most comments to count{extra}",
        )
    cfloor, c1 = _med(cat.get("floor", [])), _med(cat.get("job_1", []))
    if cfloor and c1:
        r = c1 / cfloor
        add(
            "popularity",
            f"{r:.2f}x ({c1:.1f} s vs {cfloor:.1f} s)",
            1.1,
            r <= 1.1,
            _why_catalog(res, r),
        )
    for job, key, item in (("news", "dag_news", "full_1"), ("catalog", "dag_catalog", "job_1")):
        dag = res.get(job, {}).get("dag")
        base = _med(res.get(job, {}).get("items", {}).get(item, []))
        if dag and base:
            added = dag["wall_s"] - base
            n_ti = len(dag.get("tasks", []))
            add(
                key,
                f"+{added:.1f} s ({dag['wall_s']:.1f} s vs {base:.1f} s)",
                30,
                added <= 30,
                f"{n_ti} task instances run by dag.test() one after the other, each with "
                f"Airflow's task start-up, XCom and a new database connection; "
                f"state {dag['state']}",
            )
    rss = _rss_pair(all_results or [res])
    if rss:
        (s_lo, lo), (s_hi, hi) = rss
        diff = (hi - lo) / lo
        add(
            "rss",
            f"{lo / 1024:.0f} MiB at {s_lo:g} vs {hi / 1024:.0f} MiB at {s_hi:g} ({diff:+.1%})",
            0.1,
            abs(diff) <= 0.10,
            "a worker holds one batch at a time (ids and counters of at most batch_size rows); "
            "its memory does not grow with the table"
            if abs(diff) <= 0.10
            else "peak memory grows with the data: something is held per row",
        )
    else:
        name, target = TARGETS["rss"]
        out.append(
            {
                "key": "rss",
                "name": name,
                "target": target,
                "measured": "-",
                "met": None,
                "reason": "needs results at scale 0.1 and 1 "
                "(run `make bench SCALE=0.1` and `make bench`)",
            }
        )
    return out


def _rss_pair(all_results: list[dict]):
    by = {}
    for r in all_results:
        vals = [r.get(j, {}).get("worker_hwm_kb_1range") for j in ("news", "catalog")]
        vals = [v for v in vals if v]
        if vals:
            by[r["scale"]] = max(vals)
    if 0.1 in by and 1.0 in by:
        return (0.1, by[0.1]), (1.0, by[1.0])
    if len(by) >= 2:
        lo, hi = min(by), max(by)
        return (lo, by[lo]), (hi, by[hi])
    return None


def _stmt_share(run: dict) -> list[tuple[str, int, float]]:
    st = run.get("statements") or {}
    return sorted(((k, v[0], v[1]) for k, v in st.items()), key=lambda x: -x[2])


def _why_full(res: dict, item: str, ratio: float, limit: float) -> str:
    runs = res["news"]["items"][item]
    mid = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
    st = _stmt_share(mid)
    total = sum(s for _, _, s in st) or 1
    top = ", ".join(f"{k} {s / total:.0%}" for k, _, s in st[:3])
    b = mid.get("batches") or 1
    stmts = sum(n for _, n, _ in st) / b
    parts = [
        f"{mid['batches']:,} batches of {mid['rows'] // b:,} posts, "
        f"{stmts:.1f} round trips per batch; time in the database by statement: {top}"
    ]
    if item == "full_2":
        r1 = _med(res["news"]["items"].get("full_1", []))
        if r1:
            parts.append(
                f"two ranges are {r1 / mid['seconds']:.2f}x faster than one "
                f"(2 CPU cores shared by 2 workers and 2 backends)"
            )
    return "; ".join(parts)


def _why_catalog(res: dict, ratio: float) -> str:
    runs = res["catalog"]["items"]["job_1"]
    mid = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
    st = _stmt_share(mid)
    total = sum(s for _, _, s in st) or 1
    top = ", ".join(f"{k} {s / total:.0%}" for k, _, s in st[:3])
    return f"{mid['batches']:,} batches; time in the database by statement: {top}"


def _job_table(res: dict, job: str) -> list[str]:
    sec = res[job]
    items = sec["items"]
    floor = _med(items.get("floor", []))
    labels = (
        {
            "floor": "floor: one UPDATE of all posts",
            "full_1": "FullSweep, job code, 1 range",
            "full_2": "FullSweep, job code, 2 ranges in parallel",
            "window_1": "DailyWindow, job code, 1 range",
            "window_floor": "DailyWindow as one UPDATE (reference)",
        }
        if job == "news"
        else {
            "floor": "floor: one INSERT .. ON CONFLICT + one UPDATE",
            "job_1": "popularity run, job code, 1 range",
            "job_2": "popularity run, job code, 2 ranges in parallel",
        }
    )
    rows = [
        "| measurement | min s | median s | x floor | rows | rows/s | changed | batches "
        "| lock p50 ms | lock p99 ms | worker peak RSS |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    hwm1, hwm2 = sec.get("worker_hwm_kb_1range"), sec.get("worker_hwm_kb_2ranges")
    for key, label in labels.items():
        runs = items.get(key) or []
        if not runs:
            continue
        secs = _secs(runs)
        med = median(secs)
        lock = [ms for r in runs for ms in r.get("lock_ms", [])]
        rows_n = runs[0]["rows"]
        rss = "-"
        if key in ("full_1", "window_1", "job_1"):
            rss = _mb(hwm1)
        elif key in ("full_2", "job_2"):
            rss = _mb(hwm2) + " each"
        batches = (
            runs[0].get("batches", "-")
            if "batches" in runs[0]
            else "1 statement"
            if job == "news"
            else "2 statements"
        )
        rows.append(
            f"| {label} | {min(secs):.2f} | {med:.2f} | "
            f"{'-' if key == 'floor' or not floor else f'{med / floor:.2f}x'} | {rows_n:,} | "
            f"{rows_n / med:,.0f} | {runs[0]['changed']:,} | {batches} | "
            f"{_f(pct(lock, 50), 1)} | {_f(pct(lock, 99), 1)} | {rss} |"
        )
    dag = sec.get("dag")
    if dag:
        wall = dag["wall_s"]
        xf = f"{wall / floor:.2f}x" if floor else "-"
        rows.append(
            f"| whole DAG run through Airflow (dag.test) | {wall:.2f} | {wall:.2f} "
            f"(1 run) | {xf} | - | - | - | {len(dag.get('tasks', []))} task instances "
            f"| - | - | {_mb(dag.get('maxrss_kb'))} (whole Airflow process) |"
        )
    return rows


def _stmt_table(run: dict) -> list[str]:
    st = _stmt_share(run)
    if not st:
        return []
    total = run["seconds"]
    b = run.get("batches") or 1
    rows = [
        "| statement | calls | calls/batch | total s | ms/call | share of job time |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for k, n, s in st:
        rows.append(
            f"| {k} | {n:,} | {n / b:.2f} | {s:.2f} | {s / n * 1000:.2f} | {s / total:.0%} |"
        )
    in_db = sum(s for _, _, s in st)
    rows.append(
        f"| *all statements + commits* | {sum(n for _, n, _ in st):,} | "
        f"{sum(n for _, n, _ in st) / b:.2f} | {in_db:.2f} | | {in_db / total:.0%} |"
    )
    return rows


def _describe(name: str, v: dict) -> str:
    try:
        from bench import variants

        base, _, nr = name.partition("@")
        return variants.VARIANTS[base].description + (f" -- {nr} ranges in parallel" if nr else "")
    except Exception:  # noqa: BLE001 - a variant that no longer exists
        return v["description"]


def _variants_table(sec: dict, baseline_key: str) -> list[str]:
    var = sec.get("variants")
    if not var:
        return []
    news = "window_1" in sec["items"]
    vb = var.get("baseline")
    base = _med(vb["runs"]) if vb else _med(sec["items"][baseline_key])
    wbase = (
        _med(vb["window_runs"])
        if vb and vb.get("window_runs")
        else _med(sec["items"].get("window_1", []))
    )
    head = "| variant | what | full run median s | vs baseline |"
    if news:
        head += " DailyWindow median s | vs baseline |"
    head += (
        " lock p50 ms | lock p99 ms | lock statement ms, first / last tenth of the batches "
        "| batches | same result |"
    )
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, v in var.items():
        runs = v["runs"]
        med = _med(runs)
        lock = [ms for r in runs for ms in r.get("lock_ms", [])]
        first = median(
            [r["lock_stmt_first10_ms"] for r in runs if r.get("lock_stmt_first10_ms") is not None]
        )
        last = median(
            [r["lock_stmt_last10_ms"] for r in runs if r.get("lock_stmt_last10_ms") is not None]
        )
        cells = [name, _describe(name, v), f"{med:.2f}", f"{med / base:.2f}x"]
        if news:
            wm = _med(v.get("window_runs") or [])
            cells += [_f(wm, 2), f"{wm / wbase:.2f}x" if wm and wbase else "-"]
        same = all(r.get("same_result") for r in runs + (v.get("window_runs") or []))
        cells += [
            _f(pct(lock, 50), 1),
            _f(pct(lock, 99), 1),
            f"{_f(first, 2)} / {_f(last, 2)}",
            f"{runs[0].get('batches', 0):,}",
            "yes" if same else "NO",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _explain_section(sec: dict) -> list[str]:
    ex = sec.get("explain")
    if not ex:
        return []
    rows = [
        "| statement (one batch, middle of the keyset) | execution ms | planning ms |",
        "|---|---:|---:|",
    ]
    for name, e in ex.items():
        if isinstance(e, dict) and "ms" in e:
            rows.append(f"| {name} | {_f(e['ms'], 2)} | {_f(e.get('plan_ms'), 2)} |")
        elif isinstance(e, (int, float)):
            rows.append(f"| {name} | {e:.2f} (wall, median) | |")
    return rows


def _dag_section(sec: dict) -> list[str]:
    dag = sec.get("dag")
    if not dag:
        return []
    tasks = dag.get("tasks", [])
    rows = [
        f"Whole run: {dag['wall_s']:.1f} s wall (DAG file parse included), state "
        f"`{dag['state']}`, conf `{json.dumps(dag.get('conf'))}`.",
        "",
        "| task | map index | duration s |",
        "|---|---:|---:|",
    ]
    for t in tasks:
        rows.append(
            f"| {t['task_id']} | {t['map_index'] if t['map_index'] >= 0 else ''} | "
            f"{_f(t['duration'], 2)} |"
        )
    work = sum(t["duration"] or 0 for t in tasks)
    rows.append(f"| *sum of task durations* | | {work:.2f} |")
    return rows


def _facts(res: dict) -> list[str]:
    f = res["facts"]
    return [
        f"- CPU: {f.get('cpu_count')} cores ({f.get('cpu_model')}); RAM {f.get('ram_gib')} GiB; "
        f"{f.get('platform')}",
        f"- PostgreSQL {f.get('postgresql')} (embedded `pgserver`, unix socket): "
        f"shared_buffers {f.get('pg_shared_buffers')}, work_mem {f.get('pg_work_mem')}, "
        f"max_parallel_workers_per_gather {f.get('pg_max_parallel_workers_per_gather')}, "
        f"jit {f.get('pg_jit')}, random_page_cost {f.get('pg_random_page_cost')}",
        f"- Python {f.get('python')}, apache-airflow {f.get('airflow')}, "
        f"apache-airflow-providers-postgres {f.get('postgres_provider')}, "
        f"psycopg {f.get('psycopg')}",
        f"- load average at start / end: {res.get('loadavg_start')} / {res.get('loadavg_end')}",
        f"- job code measured at commit {_code(res.get('code'))}"
        + (
            f"; scratch variants measured afterwards (`--variants-only` runs), the last one at "
            f"{_code(res.get('variants_code'))}"
            if res.get("variants_code")
            else ""
        ),
    ]


def _code(c: dict | None) -> str:
    if not c:
        return "?"
    out = f"`{c.get('head')}`"
    if c.get("modified"):
        out += " + uncommitted changes in " + ", ".join(f"`{m}`" for m in c["modified"])
    if c.get("note"):
        out += f" ({c['note']})"
    return out


def _data(res: dict) -> list[str]:
    out = []
    n = res.get("news", {}).get("meta")
    if n:
        f = n["facts"]
        out.append(
            f"- news: {f['posts']:,} posts ({f['archived']:,} archived), {f['comments']:,} "
            f"comments ({f['visible_comments']:,} visible), {f['posts_without_comments']:,} "
            f"posts without comments, hottest post {f['max_comments_per_post']:,} comments, "
            f"{f['drifted']:,} drifted counters, {f['comments_changed_26h']:,} comments changed "
            f"in the last 26 h (on {f['posts_with_changes_26h']:,} posts); database "
            f"{n['db_size']}, generated in {n['generate_s']} s"
        )
    c = res.get("catalog", {}).get("meta")
    if c:
        f = c["facts"]
        out.append(
            f"- catalog: {f['property_object_cards']:,} property-object + "
            f"{f['project_cards']:,} project cards ({f['published']:,} published, "
            f"{f['delisted']:,} delisted), {f['snapshots']:,} snapshots over {f['nights']} "
            f"nights ({f['first_night']} .. {f['last_night']}), as_of_date {c['as_of']}; "
            f"database {c['db_size']}, generated in {c['generate_s']} s"
        )
    return out


def render(all_results: list[dict]) -> str:
    lines = [
        "# Benchmark results",
        "",
        "Generated by `bench/report.py` from `bench/out/results_s*.json` "
        "(see `bench/README.md` for what is measured and how); the analysis comes from "
        "`bench/findings.md`. Times are wall-clock seconds; *min* and *median* over the "
        "repetitions; every repetition starts from the same data (reset + VACUUM). "
        "*x floor* = median / median of the floor. Full scale first, then 10 %.",
        "",
    ]
    if FINDINGS_MD.exists():
        lines += [FINDINGS_MD.read_text().rstrip(), ""]
    for res in sorted(all_results, key=lambda r: -r["scale"]):
        lines += [
            f"## Scale {res['scale']:g}",
            "",
            f"Run {res['started_at'][:19].replace('T', ' ')} UTC, {res['reps']} "
            f"repetitions, total {res.get('total_s', '?')} s. Command: "
            f"`{res['command']}` (`make bench SCALE={res['scale']:g}`).",
            "",
        ]
        lines += _facts(res) + _data(res) + [""]
        lines += [
            "### Targets",
            "",
            "| target | limit | measured (medians) | met? | why |",
            "|---|---|---|---|---|",
        ]
        for t in evaluate(res, all_results):
            met = "n/a" if t["met"] is None else ("**met**" if t["met"] else "**not met**")
            lines.append(
                f"| {t['name']} | {t['target']} | {t['measured']} | {met} | {t['reason']} |"
            )
        lines.append("")
        for job, title, key in (
            ("news", "news_comment_reconcile", "full_1"),
            ("catalog", "catalog_popularity_recompute", "job_1"),
        ):
            if job not in res:
                continue
            sec = res[job]
            lines += [f"### {title}", ""]
            if sec.get("from_run_started_at"):
                lines += [f"(section from the run of {sec['from_run_started_at'][:19]})", ""]
            lines += _job_table(res, job) + [""]
            runs = sec["items"].get(key) or []
            if runs:
                mid = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
                lines += [
                    f"Where the job code spends its time ({key}, median repetition: "
                    f"{mid['seconds']:.2f} s; plan {mid['plan_s']:.2f} s, ranges "
                    f"{mid['ranges_s']:.2f} s, summary + release {mid['finish_s']:.2f} s; "
                    f"the batch lock statement takes {_f(mid.get('lock_stmt_first10_ms'))}"
                    f" ms in the first tenth of the batches and "
                    f"{_f(mid.get('lock_stmt_last10_ms'))} ms in the last):",
                    "",
                ]
                lines += _stmt_table(mid) + [""]
            if job == "news" and sec["items"].get("window_1"):
                wruns = sec["items"]["window_1"]
                mid = sorted(wruns, key=lambda r: r["seconds"])[len(wruns) // 2]
                lines += [
                    f"DailyWindow, median repetition ({mid['seconds']:.2f} s; plan incl. "
                    f"candidate scan {mid['plan_s']:.2f} s; lock statement "
                    f"{_f(mid.get('lock_stmt_first10_ms'))} ms in the first tenth of the "
                    f"batches, {_f(mid.get('lock_stmt_last10_ms'))} ms in the last):",
                    "",
                ]
                lines += _stmt_table(mid) + [""]
            ex = _explain_section(sec)
            if ex:
                lines += ["EXPLAIN ANALYZE (full plans in `bench/out/explain-*.txt`):", ""] + ex
                lines.append("")
            vt = _variants_table(sec, key)
            if vt:
                lines += (
                    [
                        "Scratch variants (one range unless marked `@2`, whole run, same data; "
                        "`bench/variants.py` monkeypatches `pin_nightly.db.sql` in the worker "
                        "and the coordinator, nothing in plugins/ or include/sql changes; "
                        "*vs baseline* = against the `baseline` row of the same table, i.e. "
                        "the code at the time of the variant runs):",
                        "",
                    ]
                    + vt
                    + [""]
                )
            ds = _dag_section(sec)
            if ds:
                lines += ["Whole DAG run through Airflow (`tools.rundag.run_dag`):", ""] + ds
                lines.append("")
        mem = []
        for job in ("news", "catalog"):
            sec = res.get(job)
            if sec:
                mem.append(
                    f"| {job} | {_mb(min(sec['worker_ready_rss_kb']))} | "
                    f"{_mb(sec['worker_hwm_kb_1range'])} | "
                    f"{_mb(sec['worker_hwm_kb_2ranges'])} |"
                )
        if mem:
            lines += (
                [
                    "Worker memory (one process per range: imports + connection, then the "
                    "peak over all repetitions):",
                    "",
                    "| job | RSS when ready | peak, 1-range worker | peak, 2-range workers |",
                    "|---|---:|---:|---:|",
                ]
                + mem
                + [""]
            )
    return "\n".join(lines) + "\n"


def write() -> Path:
    RESULTS_MD.write_text(render(load_all()))
    return RESULTS_MD


def console_summary(res: dict) -> str:
    out = [f"scale {res['scale']:g}:"]
    for t in evaluate(res, load_all()):
        met = "n/a" if t["met"] is None else ("MET" if t["met"] else "NOT MET")
        out.append(f"  {met:8} {t['name']} ({t['target']}): {t['measured']}")
    return "\n".join(out)


if __name__ == "__main__":
    print(write())
