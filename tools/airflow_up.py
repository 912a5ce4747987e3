"""make airflow: the real Airflow (``airflow standalone``) on 127.0.0.1, metadata and job data
on the embedded PostgreSQL (or PIN_PG_DSN), pools imported, connections set, demo data loaded.

Stop it with Ctrl-C, or ``make stop`` from another shell (``python -m tools.airflow_up stop``):
every process of it gets SIGTERM (:func:`tools.proc.stop_tree`, SIGKILL after a timeout to any
that ignores it); this supervisor, signalled first, stops what is left of Airflow and, as it
exits, the embedded PostgreSQL it started. ``make stop`` waits for it and says how many
processes it stopped.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from datetime import UTC, datetime

import psutil

from tools import devenv
from tools.proc import Proc, stop_tree
from tools.stack import AIRFLOW, Stack, stack_env

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
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # make stop: as Ctrl-C
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
    # airflow standalone starts its components as `airflow` from PATH: put the virtualenv first,
    # so that `make airflow` works from a plain shell
    env["PATH"] = os.pathsep.join([str(AIRFLOW.parent), env.get("PATH", "")])
    stack = Stack(HOME, env).prepare()
    log = HOME / "standalone.log"
    airflow = Proc("airflow standalone", [AIRFLOW, "standalone"], env, log, stack.healthy).start()
    PIDFILE.write_text(f"{os.getpid()} {airflow.pid}")  # this supervisor, the Airflow session
    pw_file = HOME / "simple_auth_manager_passwords.json.generated"
    try:
        airflow.wait_ready(240)
        stack.warm_execution_api(240)
        password = json.loads(pw_file.read_text()).get("admin", "?") if pw_file.exists() else "?"
        print(
            f"\nAirflow is ready: http://127.0.0.1:{PORT}  login: admin / {password}\n"
            f"DAGs start paused: unpause them in the UI or trigger a run.\n"
            f"Job data: databases pin_airflow_news / pin_airflow_catalog "
            f"(connections news_db, catalog_db). Logs: {HOME.relative_to(devenv.REPO)}/\n"
            f"Stop: Ctrl-C here, or `make stop`.",
            flush=True,
        )
        code = airflow.popen.wait()
        print(f"Airflow exited with code {code}:\n{airflow.tail()}", file=sys.stderr, flush=True)
        return 1
    except (RuntimeError, TimeoutError) as exc:
        print(f"Airflow did not start ({exc}):\n{airflow.tail()}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # stopping: not to be interrupted
            signal.signal(sig, signal.SIG_IGN)
        airflow.stop()
        PIDFILE.unlink(missing_ok=True)


def _ours(pid: int) -> bool:
    """Whether ``pid`` (from the pid file) is still a process of `make airflow`."""
    try:
        return "airflow" in " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


def stop(timeout: float = 90) -> int:
    """make stop: stop a running `make airflow`, its supervisor and every process of Airflow
    (see the module's docstring); SIGKILL what is left after ``timeout``."""
    if not PIDFILE.exists():
        print("make airflow is not running")
        return 0
    stopped = stop_tree(*filter(_ours, map(int, PIDFILE.read_text().split())), timeout=timeout)
    PIDFILE.unlink(missing_ok=True)
    print(
        f"stopped Airflow: {len(stopped)} process(es)"
        if stopped
        else "make airflow was not running (stale pid file removed)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(stop() if sys.argv[1:] == ["stop"] else main())
