"""Fixtures: a real PostgreSQL (embedded unless PIN_PG_DSN is set) and a real Airflow home.

The Airflow environment is set before anything imports airflow.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tools import devenv
from tools.devenv import REPO

# PIN_TEST_ID keeps concurrent test sessions on one machine apart (databases, Airflow home),
# and each pytest-xdist worker of a session has its own as well.
SUFFIX = os.environ.get("PIN_TEST_ID", "") + os.environ.get("PYTEST_XDIST_WORKER", "")
TEST_HOME = REPO / ".airflow" / f"test{SUFFIX}"
# A fresh metadata database each session, on tmpfs where there is one: SQLite syncs every
# commit to disk, and dag.test() commits a few dozen times a run.
_SHM = Path("/dev/shm")  # noqa: S108 - a throwaway database of this test session
METADATA = (
    _SHM / f"pin-nightly-{hashlib.sha256(bytes(REPO)).hexdigest()[:8]}{SUFFIX}.db"
    if _SHM.is_dir() and os.access(_SHM, os.W_OK)
    else TEST_HOME / "airflow.db"
)
devenv.drop_sqlite(METADATA)
devenv.apply_airflow_env(TEST_HOME, METADATA)

import psycopg  # noqa: E402
import pytest  # noqa: E402

from tests import helpers  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def airflow_home():
    devenv.init_airflow(TEST_HOME, METADATA)
    yield TEST_HOME
    devenv.drop_sqlite(METADATA)


@pytest.fixture(scope="session")
def pg_admin() -> str:
    return devenv.admin_dsn()


_templates: set[str] = set()


def _database(name: str, env_var: str, schema_fn):
    """A fresh database ``name``: a copy of a template that ``schema_fn`` built once in this
    session (a copy takes milliseconds, the DDL and its indexes much longer)."""
    template = f"{name}_template{SUFFIX}"
    if template not in _templates:
        schema_fn(devenv.recreate_database(template))
        _templates.add(template)
    dsn = devenv.recreate_database(name + SUFFIX, template=template)
    os.environ[env_var] = devenv.airflow_connection(dsn)
    conn = psycopg.connect(dsn, autocommit=True)
    return dsn, conn


def _fresh(cls, name: str, env_var: str, schema_fn):
    """A fixture's fresh database (see :func:`_database`) as a ``cls`` helper, closed after."""
    db = cls(*_database(name, env_var, schema_fn))
    yield db
    db.conn.close()  # the one it has then (a test may reconnect it)


@pytest.fixture
def news_db(pg_admin):
    """A fresh news database with the domain tables and the recommended indexes."""
    from tools.datagen import create_news_schema

    yield from _fresh(helpers.NewsDB, "pin_test_news", "AIRFLOW_CONN_NEWS_DB", create_news_schema)


@pytest.fixture
def catalog_db(pg_admin):
    """A fresh catalog database with the card tables."""
    from tools.datagen import create_catalog_schema

    env_var = "AIRFLOW_CONN_CATALOG_DB"
    yield from _fresh(helpers.CatalogDB, "pin_test_catalog", env_var, create_catalog_schema)


@pytest.fixture(scope="session")
def scheduler_dag():
    """``scheduler_dag(dag_id)``: the DAG as the scheduler holds it (serialized and back), parsed
    once per session; its ``params.deep_merge(conf).validate()`` is the check Airflow makes
    before it creates a run with ``conf``."""
    from airflow.serialization.serialized_objects import DagSerialization

    from tools.rundag import load_dag

    cache = {}

    def get(dag_id: str):
        if dag_id not in cache:
            dag = load_dag(dag_id)
            cache[dag_id] = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag))
        return cache[dag_id]

    return get


def pytest_collection_modifyitems(items):
    """The tests marked ``long`` first, the others in their order: the pytest-xdist workers
    start them at once, and none ends a tier on one while the others wait."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
