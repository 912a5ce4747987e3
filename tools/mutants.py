"""``make mutants``: does the bounded profile of the model-based test catch known defects?

Each mutant of ``tools/mutants.toml`` is one small edit of a file under ``plugins/`` or
``include/sql/``. The runner copies the repository (its working tree, without the venv, the
embedded PostgreSQL's data or Airflow's homes) to a scratch directory, checks that the copy's
job package and SQL are what the tests import there, runs the unmutated bounded profile once
(it must pass), then puts back each mutant alone and runs the bounded profile of its job
(``tests/test_model.py -k <job> -x``): it must fail. It prints a table (mutant, caught,
seconds) and exits non-zero when a mutant survives, an entry no longer matches the code, or a
run ends other than by passing or failing tests.

``python -m tools.mutants [NAME ...] [--keep]``: only the named mutants; keep the scratch copy.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIST = REPO / "tools" / "mutants.toml"
# not copied: the venv (the scratch copy runs with this one's python), the embedded server's
# data (the copy starts a server of its own), Airflow homes, caches
SKIP = (".venv", ".git", ".pgdata", ".pgdata.lock", ".airflow", "__pycache__", "*.egg-info")
TIMEOUT = 30 * 60  # seconds for one run of the bounded profile


def load(names: list[str]) -> list[dict]:
    mutants = tomllib.loads(LIST.read_text())["mutant"]
    unknown = set(names) - {m["name"] for m in mutants}
    if unknown:
        sys.exit(f"no such mutant: {', '.join(sorted(unknown))}")
    stale = []
    for m in mutants:
        if not m["file"].startswith(("plugins/", "include/sql/")):
            stale.append(f"{m['name']}: {m['file']} is not under plugins/ or include/sql/")
            continue
        count = (REPO / m["file"]).read_text().count(m["old"])
        if count != 1:
            stale.append(f"{m['name']}: its old text occurs {count} times in {m['file']}")
    if stale:
        sys.exit("tools/mutants.toml no longer matches the code:\n  " + "\n  ".join(stale))
    return [m for m in mutants if not names or m["name"] in names]


def scratch_copy() -> Path:
    root = Path(tempfile.mkdtemp(prefix="pin-mutants-"))
    copy = root / "repo"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(*SKIP), symlinks=True)
    return copy


def environment(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    # the job package is installed editable from this repository's plugins/: the copy's must
    # come first; DAGs, SQL and the harness are found from the copy's own tools/devenv.py
    env["PYTHONPATH"] = os.pathsep.join([str(copy / "plugins"), str(copy)])
    env["AIRFLOW__CORE__DAGS_FOLDER"] = str(copy / "dags")
    env["PIN_TEST_ID"] = "mutants"
    env.pop("PIN_SQL_DIR", None)
    env.pop("PIN_MODEL_PROFILE", None)
    return env


def check_imports(copy: Path, env: dict[str, str]) -> None:
    probe = (
        "import pin_nightly, pin_nightly.db as db, tools.devenv as d; "
        "print(pin_nightly.__file__); print(db.sql_dir()); "
        "print(d.REPO)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=copy, env=env, capture_output=True, text=True
    )
    lines = [line for line in out.stdout.splitlines() if line]
    if out.returncode != 0 or not lines or any(not line.startswith(str(copy)) for line in lines):
        sys.exit(f"the scratch copy does not import its own code: {out.stdout}{out.stderr}")


def run_profile(copy: Path, env: dict[str, str], job: str | None) -> tuple[int, float, str]:
    cmd = [sys.executable, "-m", "pytest", "tests/test_model.py", "-x", "-q", "-p", "no:logging"]
    if job:
        cmd += ["-k", job]
    started = time.monotonic()
    try:
        out = subprocess.run(
            cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=TIMEOUT
        )
    except subprocess.TimeoutExpired:
        return -1, time.monotonic() - started, "timed out"
    first = next((line for line in out.stdout.splitlines() if line.startswith("E ")), "")
    return out.returncode, time.monotonic() - started, first[:150]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.mutants")
    ap.add_argument("names", nargs="*", help="only these mutants")
    ap.add_argument("--keep", action="store_true", help="keep the scratch copy")
    args = ap.parse_args(argv)
    mutants = load(args.names)
    copy = scratch_copy()
    env = environment(copy)
    check_imports(copy, env)
    print(f"scratch copy: {copy}", flush=True)
    jobs = sorted({m["job"] for m in mutants})
    rc, seconds, why = run_profile(copy, env, jobs[0] if len(jobs) == 1 else None)
    print(f"unmutated bounded profile ({', '.join(jobs)}): rc={rc} in {seconds:.0f} s", flush=True)
    if rc != 0:
        print(f"the bounded profile fails without a mutant: {why}")
        return 1
    rows, bad = [], 0
    for m in mutants:
        target = copy / m["file"]
        original = target.read_text()
        target.write_text(original.replace(m["old"], m["new"]))
        try:
            rc, seconds, why = run_profile(copy, env, m["job"])
        finally:
            target.write_text(original)
        caught = {1: "yes", 0: "NO"}.get(rc, f"error (rc {rc})")
        bad += caught != "yes"
        rows.append((m["name"], m["job"], caught, f"{seconds:.0f}", why))
        print(f"{m['name']}: caught={caught} in {seconds:.0f} s  {why}", flush=True)
    widths = [
        max(len(r[i]) for r in [("mutant", "job", "caught", "seconds", ""), *rows])
        for i in range(4)
    ]
    print()
    print("  ".join(h.ljust(w) for h, w in zip(("mutant", "job", "caught", "seconds"), widths)))
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r[:4], widths)))
    print(f"\n{len(rows) - bad} of {len(rows)} caught")
    if not args.keep:
        shutil.rmtree(copy.parent, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
