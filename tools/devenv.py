"""Local environment for the demo, the tests and the benchmarks.

- PostgreSQL: the server named by ``PIN_PG_DSN`` (a libpq DSN or URI with rights to create
  databases), else an embedded PostgreSQL 16 (the ``pgserver`` wheel) with its data in
  ``.pgdata/`` of the repository, on a unix socket.
- Airflow: a home in ``.airflow/`` of the repository (SQLite metadata), this repository's
  ``dags/`` and ``plugins/``, no examples, pools imported from ``pools.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PGDATA = REPO / ".pgdata"

_server = None


def admin_dsn() -> str:
    """DSN of a PostgreSQL server with rights to create databases; starts the embedded one."""
    global _server
    dsn = os.environ.get("PIN_PG_DSN")
    if dsn:
        return dsn
    if _server is None:
        import logging

        import pgserver

        logging.getLogger("pgserver").setLevel(logging.WARNING)
        _server = pgserver.get_server(str(PGDATA), cleanup_mode="stop")
    return _server.get_uri()


def dsn_for(dbname: str) -> str:
    from psycopg.conninfo import make_conninfo

    return make_conninfo(admin_dsn(), dbname=dbname)


def recreate_database(dbname: str) -> str:
    """Drop and create ``dbname``; return its DSN."""
    import psycopg

    with psycopg.connect(admin_dsn(), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{dbname}"')
    return dsn_for(dbname)


def airflow_connection(dsn: str) -> str:
    """An Airflow connection (JSON form of AIRFLOW_CONN_*) for a libpq DSN."""
    from psycopg.conninfo import conninfo_to_dict

    d = conninfo_to_dict(dsn)
    conn = {
        "conn_type": "postgres",
        "host": d.get("host") or "localhost",
        "login": d.get("user") or "postgres",
        "password": d.get("password") or "",
        "schema": d.get("dbname") or "postgres",
    }
    if d.get("port"):
        conn["port"] = int(d["port"])
    return json.dumps(conn)


def airflow_env(home: Path | None = None) -> dict[str, str]:
    home = home or REPO / ".airflow"
    return {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": os.environ.get("PIN_LOG_LEVEL", "INFO"),
        "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "120",
        "PYTHONPATH": os.pathsep.join(
            [str(REPO / "plugins"), str(REPO)]
            + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        ),
    }


def apply_airflow_env(home: Path | None = None) -> dict[str, str]:
    env = airflow_env(home)
    os.environ.update(env)
    return env


def airflow_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("airflow")
    return subprocess.run(
        [str(exe), *args], env=os.environ.copy(), check=check, capture_output=True, text=True
    )


def init_airflow(home: Path | None = None) -> None:
    """Migrate the metadata database (once) and import the pools."""
    env = apply_airflow_env(home)
    Path(env["AIRFLOW_HOME"]).mkdir(parents=True, exist_ok=True)
    marker = Path(env["AIRFLOW_HOME"]) / ".migrated"
    if not marker.exists():
        airflow_cli("db", "migrate")
        marker.touch()
    airflow_cli("pools", "import", str(REPO / "pools.json"))


def run_sql_file(dsn: str, relpath: str) -> None:
    import psycopg

    text = (REPO / "include" / "sql" / relpath).read_text()
    with psycopg.connect(dsn, autocommit=True) as conn:
        if "CONCURRENTLY" in text:  # one statement per call, outside a transaction
            code = "\n".join(
                line for line in text.splitlines() if not line.lstrip().startswith("--")
            )
            for stmt in filter(str.strip, code.split(";")):
                conn.execute(stmt)
        else:
            conn.execute(text)
