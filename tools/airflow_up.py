"""make airflow: the real Airflow (``airflow standalone``) on 127.0.0.1, metadata and job data
on the embedded PostgreSQL (or PIN_PG_DSN), pools imported, connections set, demo data loaded.

Stop it with Ctrl-C, or ``make stop`` from another shell (``python -m tools.airflow_up stop``):
the whole process group of ``airflow standalone`` is stopped (SIGTERM, then SIGKILL after a
timeout; the LocalExecutor's idle workers ignore SIGTERM), and what was stopped is reported.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from datetime import UTC, datetime

from tools import devenv
from tools.stack import stack_env

HOME = devenv.REPO / ".airflow" / "standalone"
PORT = int(os.environ.get("PIN_AIRFLOW_PORT", "8080"))
PIDFILE = devenv.REPO / ".airflow" / "standalone.pid"


def _ensure_db(name: str, loader) -> str:
    import psycopg

    with psycopg.connect(devenv.admin_dsn(), autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
    if exists:
        return devenv.dsn_for(name)
    dsn = devenv.recreate_database(name)
    loader(dsn)
    return dsn


def main() -> int:
    from tools import datagen
    from tools.demo import datagen_demo_catalog, datagen_demo_news

    def news(dsn):
        datagen.news(dsn, **datagen_demo_news())

    def catalog(dsn):
        datagen.catalog(dsn, **datagen_demo_catalog(datetime.now(UTC).date()))

    news_dsn = _ensure_db("pin_airflow_news", news)
    catalog_dsn = _ensure_db("pin_airflow_catalog", catalog)
    meta = _ensure_db("pin_airflow_metadata", lambda _dsn: None)
    env = stack_env(
        HOME,
        meta,
        PORT,
        {
            "AIRFLOW_CONN_NEWS_DB": devenv.airflow_connection(news_dsn),
            "AIRFLOW_CONN_CATALOG_DB": devenv.airflow_connection(catalog_dsn),
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
            "AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": "True",  # unpause a DAG: it runs nightly
            "AIRFLOW__CORE__DEFAULT_TASK_RETRIES": "2",
        },
    )
    HOME.mkdir(parents=True, exist_ok=True)
    # airflow standalone starts its components as `airflow` from PATH: put the virtualenv first,
    # so that `make airflow` works from a plain shell
    bindir = devenv.REPO / ".venv" / "bin"
    env["PATH"] = os.pathsep.join([str(bindir), env.get("PATH", "")])
    exe = str(bindir / "airflow")
    subprocess.run([exe, "db", "migrate"], env=env, check=True, capture_output=True)
    subprocess.run(
        [exe, "pools", "import", str(devenv.REPO / "pools.json")],
        env=env,
        check=True,
        capture_output=True,
    )
    log_path = HOME / "standalone.log"
    # a session of its own: `make stop` stops the whole process group (every component and
    # the executor's workers), not just the standalone supervisor
    proc = subprocess.Popen(
        [exe, "standalone"],
        env=env,
        stdout=open(log_path, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    PIDFILE.write_text(f"{os.getpid()} {proc.pid}")  # this supervisor, the process group
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    pw_file = HOME / "simple_auth_manager_passwords.json.generated"
    code = 0
    try:
        if not _wait_ready(proc, PORT, timeout=240):
            print(
                f"Airflow did not start: see {log_path.relative_to(devenv.REPO)}\n"
                + _tail(log_path),
                file=sys.stderr,
                flush=True,
            )
            return 1
        password = json.loads(pw_file.read_text()).get("admin", "?") if pw_file.exists() else "?"
        print(
            f"\nAirflow is ready: http://127.0.0.1:{PORT}  login: admin / {password}\n"
            f"DAGs start paused: unpause them in the UI or trigger a run.\n"
            f"Job data: databases pin_airflow_news / pin_airflow_catalog "
            f"(connections news_db, catalog_db). Logs: {HOME.relative_to(devenv.REPO)}/\n"
            f"Stop: Ctrl-C here, or `make stop`.",
            flush=True,
        )
        while proc.poll() is None and not stop["now"]:
            time.sleep(1)
        if proc.poll() is not None and not stop["now"]:
            print(
                f"Airflow exited with code {proc.returncode}:\n" + _tail(log_path),
                file=sys.stderr,
                flush=True,
            )
            code = 1
    except KeyboardInterrupt:
        pass
    finally:
        stop_group(proc.pid)
        proc.wait()
        PIDFILE.unlink(missing_ok=True)
    return code


def _wait_ready(proc: subprocess.Popen, port: int, timeout: float) -> bool:
    """True once the API server answers its health check; False if Airflow exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{port}/api/v2/monitor/health", timeout=2
            ) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(1)
    return False


def _tail(path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _group_pids(pgid: int) -> list[int]:
    """Live processes of the group (a zombie waiting for its parent to reap it is gone)."""
    out = subprocess.run(
        ["ps", "-o", "pid=,stat=", "-g", str(pgid)], capture_output=True, text=True
    )
    rows = (line.split() for line in out.stdout.splitlines() if line.strip())
    return [int(pid) for pid, stat in rows if not stat.startswith("Z")]


def stop_group(pgid: int, timeout: float = 30) -> list[int]:
    """SIGTERM the process group, wait, SIGKILL what is left; return the pids stopped."""
    pids = _group_pids(pgid)
    if not pids:
        return []
    os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _group_pids(pgid) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = _group_pids(pgid)
    if left:
        print(f"{len(left)} process(es) ignored SIGTERM after {timeout:.0f} s: SIGKILL", flush=True)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        while _group_pids(pgid):
            time.sleep(0.2)
    return pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop(timeout: float = 60) -> int:
    """make stop: stop a running `make airflow` (its supervisor stops the process group and the
    embedded PostgreSQL); whatever is left of the group after ``timeout`` is killed here."""
    if not PIDFILE.exists():
        print("make airflow is not running")
        return 0
    supervisor, pgid = (int(x) for x in PIDFILE.read_text().split())
    pids = _group_pids(pgid)
    if _alive(supervisor):
        os.kill(supervisor, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _alive(supervisor) and time.monotonic() < deadline:
            time.sleep(0.5)
    stop_group(pgid)
    PIDFILE.unlink(missing_ok=True)
    print(
        f"stopped Airflow: {len(pids)} process(es) of group {pgid}"
        if pids
        else "make airflow was not running (stale pid file removed)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(stop() if sys.argv[1:] == ["stop"] else main())
