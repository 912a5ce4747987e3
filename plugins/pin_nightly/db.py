"""Database access: connections through Airflow's PostgresHook, SQL files, transactions."""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class JobConfigError(ValueError):
    """Options or environment that make a run impossible; raised before any write."""


class DatabaseUnavailable(RuntimeError):
    """The job's database cannot be reached (retryable: Airflow retries the task)."""


def from_database(exc: BaseException) -> bool:
    """An error of the database or of reaching it (psycopg 3 or psycopg2), not of the code."""
    driver = type(exc).__module__.split(".")[0] in ("psycopg", "psycopg2")
    return driver or isinstance(exc, DatabaseUnavailable)


def sql_dir() -> Path:
    """``include/sql`` next to ``plugins/`` (override with ``PIN_SQL_DIR``)."""
    override = os.environ.get("PIN_SQL_DIR")
    if override:
        return Path(override)
    return Path(__file__).resolve().parents[2] / "include" / "sql"


_NAME = re.compile(r"^-- name: (\w+)[ \t]*$", re.M)


@functools.cache
def _statements(directory: str) -> dict[str, str]:
    """The statements of ``include/sql/<directory>``: a file is one statement named by its stem,
    or a set of named statements, each under a ``-- name: <name>`` line."""
    out: dict[str, str] = {}
    for path in sorted((sql_dir() / directory).glob("*.sql")):
        text = path.read_text(encoding="utf-8")
        parts = _NAME.split(text)
        named = dict(zip(parts[1::2], (body.strip() + "\n" for body in parts[2::2])))
        for name, body in named.items() if named else [(path.stem, text)]:
            if name in out:
                raise ValueError(f"SQL statement {directory}/{name} is defined twice ({path})")
            out[name] = body
    return out


_FRAGMENT = re.compile(r"\{(\w+/\w+)\}")


def sql(name: str) -> str:
    """The statement ``include/sql/<directory>/<name>``: a file of that name, or a named block
    of a file in that directory; a ``{<directory>/<name>}`` in it is that fragment's text (an
    expression written once, used by several statements)."""
    directory, _, statement = name.rpartition("/")
    try:
        text = _statements(directory)[statement]
    except KeyError:  # a packaging error, say where we looked
        raise FileNotFoundError(
            f"SQL statement {name!r} not found in {sql_dir() / directory} (set PIN_SQL_DIR?)"
        ) from None
    return _FRAGMENT.sub(lambda m: sql(m.group(1)).strip(), text)


def resolve(conn_id: str):
    """The ``PostgresHook`` of an Airflow connection that must exist (:class:`JobConfigError`
    naming it otherwise), without connecting."""
    from airflow.providers.postgres.hooks.postgres import PostgresHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        hook = PostgresHook(postgres_conn_id=conn_id)
        hook.connection  # noqa: B018 - resolves the Airflow connection
    except AirflowNotFoundException as exc:
        raise JobConfigError(
            f"Airflow connection {conn_id!r} is not defined: create it (UI Admin > "
            f"Connections, or AIRFLOW_CONN_{conn_id.upper()})"
        ) from exc
    return hook


# Seconds a job waits for a server to answer a new connection, unless the Airflow connection's
# extra gives its own connect_timeout: a named replica that is down pauses pacing for seconds.
CONNECT_TIMEOUT_S = 5


def connect(conn_id: str, prepare=None):
    """A new DB-API connection (psycopg 3 or psycopg2, as the hook chooses), autocommit off,
    its session prepared by ``prepare(conn)`` (default :func:`bound_session`, a job's).

    A missing Airflow connection raises :class:`JobConfigError` (not retried); an unreachable
    server raises :class:`DatabaseUnavailable` (retried). Both name the connection, and both
    happen before the task touches any data.
    """
    hook = resolve(conn_id)
    extra = hook.connection.extra_dejson
    if "connect_timeout" not in extra:  # libpq waits for the TCP timeout otherwise (minutes)
        hook.connection.extra = json.dumps({**extra, "connect_timeout": CONNECT_TIMEOUT_S})
    try:
        conn = hook.get_conn()
    except Exception as exc:  # noqa: BLE001 - re-raised with the connection named
        raise DatabaseUnavailable(
            f"cannot connect to the database of Airflow connection {conn_id!r}: {str(exc).strip()}"
        ) from exc
    conn.autocommit = False
    try:
        (prepare or bound_session)(conn)
    except BaseException:
        conn.close()
        raise
    return conn


# Every session of a job is bounded by the server (a statement that runs away, a lock it would
# wait for forever, a worker that stalls inside a transaction): the longest statement is the
# range planning (seconds at a million rows), a batch or a retention transaction takes well under
# a second at the default sizes, and the job never waits between the statements of a transaction.
# A setting that the connection (extra ``options``: ``-c lock_timeout=2s``), the job's role or
# its database already gives wins: these apply only where the session's value is 0 (off).
SESSION_BOUNDS = {
    "statement_timeout": "5min",
    "lock_timeout": "30s",
    "idle_in_transaction_session_timeout": "1min",
}


# The wal_compression methods a job session tries, in order (zstd, else lz4, else pglz: built in,
# more CPU for less); a deployment sets ``PIN_WAL_COMPRESSION`` (for example ``lz4``) or ``off``.
WAL_COMPRESSION = "zstd,lz4,pglz"


def bound_session(conn) -> dict[str, str]:
    """Apply :data:`SESSION_BOUNDS` where the session has none, and compress the full-page
    images of its WAL where the role may (``common/wal_compression``); return the session's
    timeouts."""
    methods = os.environ.get("PIN_WAL_COMPRESSION", WAL_COMPRESSION).replace(" ", "")
    with transaction(conn) as cur:
        cur.execute(sql("common/session_bounds"), SESSION_BOUNDS)
        values = dict(cur.fetchall())
        cur.execute(sql("common/server_version_num"))
        if cur.fetchone()[0] >= 150000 and methods != "off":
            cur.execute(sql("common/wal_compression"), {"methods": methods.split(",")})
            log.debug("wal_compression: %s", cur.fetchone()[0])
    log.debug("session bounds: %s", values)
    return values


@contextmanager
def connection(conn_id: str) -> Iterator[Any]:
    conn = connect(conn_id)
    try:
        yield conn
    finally:
        try:
            conn.rollback()
        except Exception:  # noqa: BLE001, S110 - the connection may already be broken
            pass
        conn.close()


@contextmanager
def transaction(conn) -> Iterator[Any]:
    """A cursor inside one transaction: commit on success, roll back on any error."""
    cur = conn.cursor()
    try:
        yield cur
        conn.commit()
    except BaseException:
        try:
            conn.rollback()
        except Exception:  # noqa: BLE001 - keep the original error
            log.warning("rollback failed after an error; the connection is broken")
        raise
    finally:
        cur.close()


def fetch_dicts(cur) -> list[dict[str, Any]]:
    if cur.description is None:
        return []
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]


def fetch_one_dict(cur) -> dict[str, Any] | None:
    rows = fetch_dicts(cur)
    return rows[0] if rows else None


def first_line(exc: BaseException) -> str:
    """The first line of an error's message (its type's name when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def sqlstate(exc: BaseException) -> str | None:
    """SQLSTATE of a psycopg 3 or psycopg2 error."""
    return getattr(exc, "sqlstate", None) or getattr(exc, "pgcode", None)


def ensure_schema(conn, probe: str, ddl_name: str) -> bool:
    """Apply ``include/sql/<ddl_name>.sql`` when relation ``probe`` is absent. True if applied."""
    with transaction(conn) as cur:
        cur.execute(sql("common/relation_exists"), {"relation": probe})
        if cur.fetchone()[0]:
            return False
        log.info("creating job-owned tables from include/sql/%s.sql", ddl_name)
        try:
            cur.execute(sql(ddl_name))
        except Exception as exc:
            if sqlstate(exc) != "42501":  # insufficient_privilege: a least-privilege job role
                raise
            raise JobConfigError(
                f"job-owned tables are missing or out of date ({probe} does not exist) and this "
                f"role may not change them: a DBA applies include/sql/{ddl_name}.sql, then "
                "include/sql/schema/roles.sql"
            ) from exc
    return True


def check_columns(conn, table: str, columns: list[str]) -> None:
    """Fail with a clear message if a domain table or one of its columns is missing."""
    schema, name = table.split(".")
    with transaction(conn) as cur:
        cur.execute(sql("common/table_columns"), {"schema": schema, "table": name})
        present = {r[0] for r in cur.fetchall()}
    if not present:
        raise JobConfigError(f"domain table {table} does not exist (or is not readable)")
    missing = [c for c in columns if c not in present]
    if missing:
        raise JobConfigError(f"domain table {table} lacks column(s): {', '.join(missing)}")


def has_index_on(conn, table: str, expression_fragment: str) -> bool:
    """Whether some index of ``table`` has ``expression_fragment`` in its definition."""
    with transaction(conn) as cur:
        cur.execute(
            sql("common/index_count"), {"table": table, "pattern": f"%{expression_fragment}%"}
        )
        return cur.fetchone()[0] > 0
