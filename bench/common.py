"""Shared bits of the benchmark harness: paths, database names, environment, small helpers."""

from __future__ import annotations

import json
import os
from datetime import UTC, date, datetime
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
OUT = BENCH / "out"
AIRFLOW_HOME = OUT / "airflow_home"
LOGS = OUT / "logs"

SEED = 20261130
# The popularity job's as_of_date in the benchmark (fixed, so that data and results are
# reproducible); history covers the 31 nights before it.
AS_OF = date(2026, 11, 1)
# The news data is generated as of this instant (so that a scale and seed always give the same
# rows, ids included); the DailyWindow's input is then moved up to the wall clock
# (bench.data.reage_news).
NEWS_ANCHOR = datetime(2026, 11, 1, tzinfo=UTC)


def scale_tag(scale: float) -> str:
    return f"{scale:g}".replace(".", "_")


def db_name(job: str, scale: float) -> str:
    return f"pin_bench_{job}_s{scale_tag(scale)}"


def setup_airflow_env() -> None:
    """Point Airflow at a home of the benchmark's own (before anything imports airflow)."""
    from tools import devenv

    OUT.mkdir(parents=True, exist_ok=True)
    LOGS.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PIN_LOG_LEVEL", "WARNING")
    devenv.apply_airflow_env(AIRFLOW_HOME)


def pct(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (p in 0..100)."""
    if not values:
        return None
    v = sorted(values)
    k = max(0, min(len(v) - 1, int(round(p / 100 * len(v) + 0.5)) - 1))
    return v[k]


def machine_facts(dsn: str) -> dict:
    import psycopg

    info = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = [ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")]
    with psycopg.connect(dsn) as conn:
        pg = [conn.execute(f"SHOW {n}").fetchone()[0] for n in ("server_version", "shared_buffers")]
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu[0] if cpu else None,
        "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "postgresql": pg[0],
        "pg_shared_buffers": pg[1],
    }


def dump_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=1, default=str))


def cpu_sample() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0, 0
    idle = f[3] + (f[4] if len(f) > 4 else 0)
    return sum(f) - idle, sum(f)


def busy_between(a: tuple[int, int], b: tuple[int, int]) -> float | None:
    dt = b[1] - a[1]
    return None if dt <= 0 else (b[0] - a[0]) / dt


def io_stalled() -> float | None:
    """Share of the last 10 s in which every task waited on I/O (``/proc/pressure/io``)."""
    try:
        full = Path("/proc/pressure/io").read_text().splitlines()[1]
    except (OSError, IndexError):
        return None
    return float(full.split()[1].split("=")[1]) / 100


def dirty_mb() -> float:
    """Page cache not yet written to disk (``Dirty`` + ``Writeback`` of /proc/meminfo), MB."""
    lines = Path("/proc/meminfo").read_text().splitlines()
    return sum(int(ln.split()[1]) for ln in lines if ln.startswith(("Dirty:", "Writeback:"))) / 1024


def wait_quiet(threshold: float = 0.2, window: float = 1.0, max_wait: float = 60.0) -> dict:
    """Wait until the machine is quiet (other processes use < threshold of all CPUs over a
    window, and the disk has caught up: tasks stalled on I/O < 2 % of the last 10 s and less
    than 64 MB of dirty pages left to write), at most max_wait seconds: the machine may be
    shared, and a run's checkpoint and the kernel's write-back of its pages go on after it."""
    import time

    t0 = time.monotonic()
    while True:
        a = cpu_sample()
        time.sleep(window)
        busy, io, dirty = busy_between(a, cpu_sample()), io_stalled(), dirty_mb()
        waited = time.monotonic() - t0
        quiet = (busy is None or busy < threshold) and (io is None or io < 0.02) and dirty < 64
        if quiet or waited >= max_wait:
            return {
                "waited_s": round(waited, 1),
                "busy_before": None if busy is None else round(busy, 3),
                "io_stalled_before": io,
                "dirty_mb_before": round(dirty, 1),
                "quiet": quiet,
            }


def code_version() -> dict:
    """The commit the job code was measured at, and which of its files differ from it."""
    import subprocess

    def git(*a: str) -> list[str]:
        out = subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True)
        return out.stdout.splitlines()

    dirty = git("status", "--porcelain", "--", "plugins", "include", "dags")
    head = git("rev-parse", "--short", "HEAD") or ["not a git checkout"]
    return {"head": head[0], "modified": [ln[3:] for ln in dirty]}
