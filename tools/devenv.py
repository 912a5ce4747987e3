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

        import fasteners
        import pgserver

        logging.getLogger("pgserver").setLevel(logging.WARNING)
        # processes starting at once (the test workers of a fresh clone) would race to create
        # the data directory: pgserver makes it with mkdir(exist_ok=False)
        with fasteners.InterProcessLock(str(REPO / ".pgdata.lock")):
            _server = pgserver.get_server(str(PGDATA), cleanup_mode="stop")
    return _server.get_uri()


def dsn_for(dbname: str) -> str:
    from psycopg.conninfo import make_conninfo

    return make_conninfo(admin_dsn(), dbname=dbname)


def recreate_database(dbname: str, template: str | None = None) -> str:
    """Drop and create ``dbname`` (a copy of database ``template`` if given); return its
    DSN. The copy is written through the WAL (PostgreSQL's default strategy since 15): for a
    small template that is faster than copying its files, which takes two checkpoints of the
    whole server and slows every other session writing to it."""
    import psycopg

    with psycopg.connect(admin_dsn(), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
        copy = f' TEMPLATE "{template}"' if template else ""
        conn.execute(f'CREATE DATABASE "{dbname}"{copy}')
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


def airflow_env(home: Path | None = None, metadata: Path | None = None) -> dict[str, str]:
    """The environment of an Airflow home; its SQLite metadata database is ``metadata``
    (default: ``airflow.db`` in the home)."""
    home = home or REPO / ".airflow"
    return {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{metadata or home / 'airflow.db'}",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": os.environ.get("PIN_LOG_LEVEL", "INFO"),
        "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "120",
        "PYTHONPATH": os.pathsep.join(
            [str(REPO / "plugins"), str(REPO)]
            + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        ),
    }


def apply_airflow_env(home: Path | None = None, metadata: Path | None = None) -> dict[str, str]:
    env = airflow_env(home, metadata)
    os.environ.update(env)
    return env


def airflow_cli(
    *args: str, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("airflow")
    return subprocess.run(
        [str(exe), *args],
        env={**os.environ, **(env or {})},
        check=check,
        capture_output=True,
        text=True,
    )


def _template_key() -> str:
    """What a migrated metadata template depends on: the Airflow version and ``pools.json``."""
    import hashlib
    from importlib.metadata import version

    return hashlib.sha256(
        version("apache-airflow").encode() + (REPO / "pools.json").read_bytes()
    ).hexdigest()[:12]


def prepare_metadata(env: dict[str, str]) -> None:
    """Migrate the metadata database of ``env`` and import the pools of ``pools.json``."""
    airflow_cli("db", "migrate", env=env)
    airflow_cli("pools", "import", str(REPO / "pools.json"), env=env)


def write_airflow_cfg(env: dict[str, str]) -> None:
    """Write the default ``airflow.cfg`` of the home of ``env`` unless it has one, as the
    ``airflow`` command does before any subcommand. Its generated secrets (the JWT secret that
    signs the task tokens among them) must be the same in every component: components started
    at once in a home without one would each write and use secrets of their own."""
    code = "import airflow.configuration as c; c.write_default_airflow_configuration_if_needed()"
    subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        check=True,
        capture_output=True,
        text=True,
    )


def _template_lock():
    import fasteners

    (REPO / ".airflow").mkdir(parents=True, exist_ok=True)
    return fasteners.InterProcessLock(str(REPO / ".airflow" / ".metadata.lock"))


def _metadata_template() -> Path:
    """A SQLite metadata database migrated once for this Airflow version and ``pools.json``,
    with the pools imported: every Airflow home of the demo and the tests starts as a copy of
    it (a migration takes ~20 s, a copy milliseconds). Safe for concurrent test workers."""
    import shutil

    home = REPO / ".airflow" / f".metadata-{_template_key()}"
    db = home / "airflow.db"
    with _template_lock():
        if not db.exists():  # built aside and renamed: a template that exists is complete
            staging = home.with_name(home.name + ".tmp")
            shutil.rmtree(staging, ignore_errors=True)
            prepare_metadata(airflow_env(staging))
            shutil.rmtree(home, ignore_errors=True)
            staging.rename(home)
    return db


def sqlalchemy_url(dsn: str) -> str:
    """The SQLAlchemy URL (psycopg2 driver) of a libpq DSN, for ``[database] sql_alchemy_conn``."""
    from psycopg.conninfo import conninfo_to_dict

    d = conninfo_to_dict(dsn)
    auth = d.get("user", "postgres") + (f":{d['password']}" if d.get("password") else "")
    hostpart = (
        f"{d['host']}:{d.get('port', 5432)}" if not str(d.get("host", "")).startswith("/") else ""
    )
    query = f"?host={d['host']}" if not hostpart else ""
    return f"postgresql+psycopg2://{auth}@{hostpart}/{d['dbname']}{query}"


def postgres_metadata(dbname: str) -> str:
    """A fresh Airflow metadata database ``dbname`` on the PostgreSQL server, migrated, with the
    pools of ``pools.json``: a copy of a template migrated once per server for this Airflow
    version and ``pools.json`` (the two CLI steps take 15 s on an idle 2-core machine and a
    stack test's setup repeated them, a copy takes a tenth of a second). Returns its DSN."""
    import psycopg

    template = f"pin_airflow_template_{_template_key()}"
    with _template_lock():
        with psycopg.connect(admin_dsn(), autocommit=True) as conn:
            found = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (template,))
            done = found.fetchone() is not None
        if not done:  # built aside and renamed: a template that exists is complete
            staging = recreate_database(f"{template}_tmp")
            home = REPO / ".airflow" / ".metadata-pg"
            url = sqlalchemy_url(staging)
            prepare_metadata({**airflow_env(home), "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": url})
            with psycopg.connect(admin_dsn(), autocommit=True) as conn:
                conn.execute(f'ALTER DATABASE "{template}_tmp" RENAME TO "{template}"')
    return recreate_database(dbname, template=template)


def init_airflow(home: Path | None = None, metadata: Path | None = None) -> None:
    """Apply the Airflow environment of ``home`` (see :func:`airflow_env`) and give it a
    migrated metadata database with the pools of ``pools.json``: a copy of
    :func:`_metadata_template`, or the existing one with its pools brought up to date."""
    import sqlite3

    env = apply_airflow_env(home, metadata)
    home = Path(env["AIRFLOW_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    db = metadata or home / "airflow.db"
    if not db.exists():
        drop_sqlite(db)  # a write-ahead log left beside it would be replayed into the copy
        with sqlite3.connect(_metadata_template()) as src, sqlite3.connect(db) as dst:
            src.backup(dst)
    else:
        airflow_cli("pools", "import", str(REPO / "pools.json"))


def drop_sqlite(db: Path) -> None:
    """Delete a SQLite database with its write-ahead log and shared-memory files."""
    for path in (db, *(db.with_name(db.name + s) for s in ("-wal", "-shm", "-journal"))):
        path.unlink(missing_ok=True)


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
