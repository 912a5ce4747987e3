"""make airflow: the real Airflow (``airflow standalone``) on 127.0.0.1, metadata and job data
on the embedded PostgreSQL (or PIN_PG_DSN), pools imported, connections set, demo data loaded.

Stop it with Ctrl-C, or ``make stop`` from another shell.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone

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
    from tools import demodata

    def news(dsn):
        demodata.create_news_schema(dsn)
        demodata.load_news_demo(dsn, posts=5000)

    def catalog(dsn):
        demodata.create_catalog_schema(dsn)
        demodata.load_catalog_demo(dsn, datetime.now(timezone.utc).date())

    news_dsn = _ensure_db("pin_airflow_news", news)
    catalog_dsn = _ensure_db("pin_airflow_catalog", catalog)
    meta = _ensure_db("pin_airflow_metadata", lambda dsn: None)
    env = stack_env(HOME, meta, PORT, {
        "AIRFLOW_CONN_NEWS_DB": devenv.airflow_connection(news_dsn),
        "AIRFLOW_CONN_CATALOG_DB": devenv.airflow_connection(catalog_dsn),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
        "AIRFLOW__CORE__DEFAULT_TASK_RETRIES": "2",
    })
    HOME.mkdir(parents=True, exist_ok=True)
    exe = str(devenv.REPO / ".venv" / "bin" / "airflow")
    subprocess.run([exe, "db", "migrate"], env=env, check=True, capture_output=True)
    subprocess.run([exe, "pools", "import", str(devenv.REPO / "pools.json")], env=env,
                   check=True, capture_output=True)
    PIDFILE.write_text(str(os.getpid()))
    proc = subprocess.Popen([exe, "standalone"], env=env, stdout=open(HOME / "standalone.log", "w"),
                            stderr=subprocess.STDOUT)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    pw_file = HOME / "simple_auth_manager_passwords.json.generated"
    try:
        for _ in range(120):
            if pw_file.exists() or proc.poll() is not None:
                break
            time.sleep(1)
        password = json.loads(pw_file.read_text()).get("admin", "?") if pw_file.exists() else "?"
        print(f"\nAirflow UI: http://127.0.0.1:{PORT}  login: admin / {password}\n"
              f"DAGs start paused: unpause them in the UI or trigger a run.\n"
              f"Job data: databases pin_airflow_news / pin_airflow_catalog "
              f"(connections news_db, catalog_db). Logs: {HOME.relative_to(devenv.REPO)}/\n"
              f"Stop: Ctrl-C here, or `make stop`.", flush=True)
        while proc.poll() is None and not stop["now"]:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        PIDFILE.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
