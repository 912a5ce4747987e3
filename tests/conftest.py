"""Fixtures: a real PostgreSQL (embedded unless PIN_PG_DSN is set) and a real Airflow home.

The Airflow environment is set before anything imports airflow.
"""

from __future__ import annotations

import os

from tools import devenv
from tools.devenv import REPO

# PIN_TEST_ID keeps concurrent test sessions on one machine apart (databases, Airflow home).
SUFFIX = os.environ.get("PIN_TEST_ID", "")
TEST_HOME = REPO / ".airflow" / f"test{SUFFIX}"
os.environ["PIN_TEST_HOME"] = str(TEST_HOME)
devenv.apply_airflow_env(TEST_HOME)

import psycopg  # noqa: E402
import pytest  # noqa: E402

from tests import helpers  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def airflow_home():
    devenv.init_airflow(TEST_HOME)
    return TEST_HOME


@pytest.fixture(scope="session")
def pg_admin() -> str:
    return devenv.admin_dsn()


def _database(name: str, env_var: str, schema_fn):
    dsn = devenv.recreate_database(name + SUFFIX)
    schema_fn(dsn)
    os.environ[env_var] = devenv.airflow_connection(dsn)
    conn = psycopg.connect(dsn, autocommit=True)
    return dsn, conn


@pytest.fixture
def news_db(pg_admin):
    """A fresh news database with the domain tables and the recommended indexes."""
    from tools.datagen import create_news_schema

    dsn, conn = _database("pin_test_news", "AIRFLOW_CONN_NEWS_DB", create_news_schema)
    db = helpers.NewsDB(dsn, conn)
    yield db
    conn.close()


@pytest.fixture
def catalog_db(pg_admin):
    """A fresh catalog database with the card tables."""
    from tools.datagen import create_catalog_schema

    dsn, conn = _database("pin_test_catalog", "AIRFLOW_CONN_CATALOG_DB", create_catalog_schema)
    db = helpers.CatalogDB(dsn, conn)
    yield db
    conn.close()
