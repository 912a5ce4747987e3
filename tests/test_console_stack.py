"""The console on a real Airflow stack (scheduler, dag-processor, triggerer and api-server on
LocalExecutor, metadata on PostgreSQL) behind the simple auth manager's login: the api-server
loads the plugin from plugins/, the UI lists its view, and the page shows a run the scheduler
ran, read through a ``news_db_readonly`` connection kept in the metadata database."""

from __future__ import annotations

import json
import shutil

import pytest

from tests import helpers
from tests.conftest import SUFFIX
from tools import devenv
from tools.stack import login_stack

pytestmark = pytest.mark.stack  # real Airflow components: make test-all

NEWS = "news_comment_reconcile"
USER = "admin"


@pytest.fixture(scope="module")
def stack(pg_admin):
    home = devenv.REPO / ".airflow" / f"console{SUFFIX}"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    news_dsn, _, metadata_dsn, conns = helpers.stack_databases("console")
    s = login_stack(home, metadata_dsn, conns, USER, migrated=True)
    try:
        s.prepare()
        # the console's connection, in the metadata database (not the environment)
        s.cli(
            "connections", "add", "news_db_readonly", "--conn-json", conns["AIRFLOW_CONN_NEWS_DB"]
        )
        s.launch()
        s.wait_for_dags([NEWS])
        s.news_dsn = news_dsn
        yield s
    finally:
        s.stop()


def test_the_api_server_serves_the_console_of_a_run_the_scheduler_ran(stack):
    import psycopg

    with psycopg.connect(stack.news_dsn, autocommit=True) as conn:
        helpers.NewsDB(stack.news_dsn, conn).posts(30, drift_every=3)
    run_id = stack.trigger(NEWS, {"scope": "FullSweep"})
    stack.wait_run(NEWS, run_id, timeout=240, expect="success")

    views = [v for p in stack.get("/api/v2/plugins")["plugins"] for v in p["external_views"]]
    (view,) = [v for v in views if v["name"] == "pin-nightly"]
    assert view["href"] == "/pin-nightly/" and view["url_route"] == "pin-nightly"

    status, body = stack.fetch("/pin-nightly/api/jobs")
    assert status == 200, body
    news = {j["dag_id"]: j for j in json.loads(body)["jobs"]}[NEWS]
    assert news["state"] == "ok" and news["conn_id"] == "news_db_readonly"
    (night,) = news["nights"]
    assert night["run_id"] == run_id and night["status"] == "success" and night["work"] == 10
    assert news["sweeps"] == [] and news["lease"] is None

    status, page = stack.fetch("/pin-nightly/")
    assert status == 200 and f'id="nights-{NEWS}"' in page and run_id in page
    status, js = stack.fetch("/pin-nightly/static/plotly.min.js", token=False)
    assert status == 200 and "plotly.js v" in js[:500]
    assert stack.fetch("/pin-nightly/api/jobs", token=False)[0] == 401
