"""The read-only console (pin_nightly.console) through Airflow's own API server app: the app
the api-server builds (plugins from plugins/ mounted, the auth manager in place), over HTTP
with FastAPI's TestClient, after real runs of the DAGs (dag.test()) on a real PostgreSQL."""

from __future__ import annotations

import html
import json
import re

import pytest

from tests.helpers import assert_ok, run_night, when
from tools.rundag import run_dag
from tools.stack import free_port

NEWS, CATALOG = "news_comment_reconcile", "catalog_popularity_recompute"
NEWS_READER = "news_reader"  # may read the news DAG only (see OneDagAuthManager)


def _simple_auth_manager():
    from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager

    return SimpleAuthManager


class OneDagAuthManager(_simple_auth_manager()):
    """Airflow's simple auth manager, with one user granted a single DAG, as an auth manager
    with per-DAG grants (FAB, Keycloak) gives them; every other user is as the simple one
    decides."""

    def is_authorized_dag(self, *, method, user, access_entity=None, details=None) -> bool:
        if user.username == NEWS_READER:
            return method == "GET" and details is not None and details.id == NEWS
        return super().is_authorized_dag(
            method=method, user=user, access_entity=access_entity, details=details
        )


@pytest.fixture(scope="module")
def api():
    """Airflow's API server app (core part) as ``airflow api-server`` builds it, with the
    auth manager above; ``api.token(user, role)`` is a JWT the auth manager issued."""
    from airflow.api_fastapi import app as api_app
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
    from fastapi.testclient import TestClient

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AIRFLOW__CORE__AUTH_MANAGER", f"{__name__}.OneDagAuthManager")
        api_app.purge_cached_app()
        client = TestClient(api_app.create_app("core"))
        manager = api_app.get_auth_manager()
        assert isinstance(manager, OneDagAuthManager)

        def jwt(username: str, role: str | None) -> str:
            return manager.generate_jwt(SimpleAuthManagerUser(username=username, role=role))

        def token(username: str, role: str | None) -> dict[str, str]:
            return {"Authorization": f"Bearer {jwt(username, role)}"}

        client.jwt, client.token = jwt, token
        yield client
        api_app.purge_cached_app()


ADMIN = ("admin", "admin")


def csrf(page: str) -> str:
    """The CSRF token the console's page embeds."""
    (token,) = re.findall(r"<meta name='csrf-token' content='([0-9a-f]{64})'>", page)
    return token


def with_csrf(api, headers: dict[str, str]) -> dict[str, str]:
    """``headers`` and the CSRF token of the page the user loads with them (the client keeps
    the console's nonce cookie, as a browser does)."""
    page = api.get("/pin-nightly/", headers=headers)
    assert page.status_code == 200, page.text
    return {**headers, "X-CSRF-Token": csrf(page.text)}


def browser(api, user=ADMIN):
    """A client holding what a browser logged in as ``user`` holds once it loaded the console's
    page (the UI's session cookie, the auth manager's JWT, and the console's nonce), and the
    page's CSRF token."""
    from airflow.api_fastapi.auth.managers.base_auth_manager import COOKIE_NAME_JWT_TOKEN
    from fastapi.testclient import TestClient

    client = TestClient(api.app)
    client.cookies.set(COOKIE_NAME_JWT_TOKEN, api.jwt(*user))
    page = client.get("/pin-nightly/")
    assert page.status_code == 200, page.text
    return client, csrf(page.text)


def jobs(api, user=ADMIN) -> dict[str, dict]:
    r = api.get("/pin-nightly/api/jobs", headers=api.token(*user))
    assert r.status_code == 200, r.text
    return {j["dag_id"]: j for j in r.json()["jobs"]}


def test_a_news_run_shows_its_open_sweep_nights_and_item_errors_with_a_repair(api, news_db):
    bad = news_db.post(count=7, visible=1)  # drifted, and a domain trigger rejects its update
    news_db.fail_updates_of(bad, errcode="raise_exception")
    news_db.posts(60, drift_every=3)
    # the run's budget ends once a few batches have committed: its sweep stays open
    when(
        lambda: news_db.one("SELECT coalesce(sum(batches), 0) FROM pin_nightly.sweep_range") >= 3,
        lambda: news_db.q("UPDATE pin_nightly.job_lease SET run_deadline_at = now()"),
    )
    r = run_dag(NEWS, {"scope": "FullSweep", "batch_size": 4, "max_ranges": 2})
    s = assert_ok(r)
    assert s["status"] == "backlog_remaining" and s["item_errors"] == 1

    news = jobs(api)[NEWS]
    assert news["state"] == "ok" and news["message"] is None
    assert news["conn_id"] == "news_db"
    (sweep,) = news["sweeps"]
    assert (sweep["sweep_id"], sweep["scope"]) == (s["sweep_id"], "FullSweep")
    planned = "SELECT sum(planned_rows) FROM pin_nightly.sweep_range WHERE sweep_id = %s"
    assert sweep["planned_rows"] == news_db.one(planned, s["sweep_id"]) > 50
    assert sweep["ranges_total"] == 2 and 0 < sweep["share_done"] < 1
    assert 0 < sweep["rows_done"] < sweep["planned_rows"]
    assert len(sweep["ranges"]) == 2 and {g["status"] for g in sweep["ranges"]} <= {
        "pending",
        "done",
    }
    assert all(g["label"].startswith("FullSweep#") for g in sweep["ranges"])
    assert sweep["rows_per_second"] and sweep["rows_per_second"] > 0
    assert sweep["seconds_left"] is not None and sweep["seconds_left"] >= 0
    (last,) = news["nights"]
    assert last["run_id"] == r["run_id"] and last["status"] == "backlog_remaining"
    assert last["work"] == s["drift_corrected"] and last["item_errors"] == 1
    assert last["duration_minutes"] == round(s["duration_ms"] / 60000, 2)
    (err,) = news["item_errors"]
    assert err["item_id"] == bad and err["run_id"] == r["run_id"]
    assert "rejected (simulated)" in err["message"] and err["sqlstate"] == "P0001"
    assert news["repair"] == {"dag_url": f"/dags/{NEWS}", "conf": {"post_ids": [bad]}}
    assert news["lease"] is None  # released by the run
    signals = {g["signal"]: g for g in news["signals"]}
    assert signals["replica_lag_seconds"]["limit"] == 30 and signals["vacuum"]["value"] is False
    assert signals["replica_lag_seconds"]["about"] == "no streaming replica"  # none here
    assert signals["wal_mb_per_second"]["value"] is None  # a running range measures it
    assert not any(g["over"] for g in signals.values())

    page = api.get("/pin-nightly/", headers=api.token(*ADMIN))
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    text = page.text
    assert "FullSweep" in text and f"sweep {s['sweep_id']}" in text
    assert bad in text and "rejected (simulated)" in text
    assert f"href='/dags/{NEWS}'" in text and f'"post_ids": [\n  "{bad}"' in html.unescape(text)
    assert f'id="nights-{NEWS}"' in text and "Plotly.newPlot" in text
    assert "<script src='static/plotly.min.js'>" in text  # served by the app, no CDN
    assert "cdn" not in text.lower()
    js = api.get("/pin-nightly/static/plotly.min.js")
    assert js.status_code == 200 and "javascript" in js.headers["content-type"]
    assert re.search(r"plotly\.js v\d+\.\d+\.\d+", js.text[:500])

    # a whole pass over the keyset that no longer fails closes the error
    news_db.allow_updates()
    assert_ok(run_dag(NEWS, {"scope": "FullSweep", "batch_size": 4, "max_ranges": 2}))
    assert_ok(run_dag(NEWS, {"scope": "FullSweep"}))
    news = jobs(api)[NEWS]
    assert news["sweeps"] == [] and news["item_errors"] == [] and news["repair"] is None
    assert [n["status"] for n in news["nights"]] == ["backlog_remaining", "success", "success"]


def test_a_catalog_run_shows_its_nights(api, catalog_db):
    from datetime import date, timedelta

    as_of = date(2026, 8, 31)
    cid = catalog_db.card(views=135)
    for days, views in ((3, 100), (2, 125), (1, 125)):  # a history: the score changes tonight
        catalog_db.seed_snapshot(cid, as_of - timedelta(days=days), views)
    catalog_db.card(views=5, kind="Project")
    r = run_night(CATALOG, {}, as_of)  # the job's clock as of that night
    s = assert_ok(r)
    cat = jobs(api)[CATALOG]
    assert cat["state"] == "ok" and cat["conn_id"] == "catalog_db"
    assert cat["sweeps"] == [] and cat["item_errors"] == []
    (last,) = cat["nights"]
    assert last["run_id"] == r["run_id"]
    assert last["work"] == s["property_object_cards_updated"] + s["project_cards_updated"] == 1
    assert cat["work_label"] == "cards updated" and cat["budget_minutes"] == 30


def test_the_console_reads_on_a_read_only_session_and_prefers_the_readonly_connection(
    api, news_db, monkeypatch
):
    from pin_nightly import console
    from pin_nightly.db import connect, sqlstate, transaction

    assert_ok(run_dag(NEWS, {"scope": "FullSweep"}))
    monkeypatch.setenv("AIRFLOW_CONN_NEWS_DB_READONLY", _conn_json(news_db.dsn))
    assert console.console_conn_id("news_db") == "news_db_readonly"
    assert jobs(api)[NEWS]["conn_id"] == "news_db_readonly"
    conn = connect("news_db_readonly", prepare=console.readonly_session)
    try:
        with pytest.raises(Exception) as exc, transaction(conn) as cur:
            cur.execute("DELETE FROM pin_nightly.run_log")
        assert sqlstate(exc.value) == "25006"  # read_only_sql_transaction
    finally:
        conn.close()
    assert news_db.one("SELECT count(*) FROM pin_nightly.run_log") == 1


@pytest.mark.xdist_group("roles")  # the group roles are cluster-wide (see test_security)
def test_the_console_reader_role_reads_the_job_state_and_nothing_else(api, news_db, monkeypatch):
    import psycopg
    from psycopg.conninfo import make_conninfo

    from tests.conftest import SUFFIX
    from tools.devenv import admin_dsn, run_sql_file

    assert_ok(run_dag(NEWS, {"scope": "FullSweep"}))
    run_sql_file(news_db.dsn, "schema/roles.sql")  # as a DBA applies it after the job's tables
    login = "pin_console_login" + re.sub(r"\W", "_", SUFFIX).lower()
    with psycopg.connect(admin_dsn(), autocommit=True) as admin:
        admin.execute(f'DROP ROLE IF EXISTS "{login}"')
        admin.execute(f'CREATE ROLE "{login}" LOGIN IN ROLE pin_console_reader')
    try:
        dsn = make_conninfo(news_db.dsn, user=login)
        monkeypatch.setenv("AIRFLOW_CONN_NEWS_DB_READONLY", _conn_json(dsn))
        news = jobs(api)[NEWS]
        assert (news["state"], news["conn_id"], len(news["nights"])) == (
            "ok",
            "news_db_readonly",
            1,
        )
        with psycopg.connect(dsn) as conn:
            for statement in (
                "DELETE FROM pin_nightly.run_log",
                "UPDATE pin_nightly.job_lease SET holder = 'x'",
                "SELECT count(*) FROM news.posts",
                "SELECT count(*) FROM pin_nightly.news_drift",
            ):
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    conn.execute(statement)
                conn.rollback()
    finally:
        with psycopg.connect(admin_dsn(), autocommit=True) as admin:
            admin.execute(f'DROP ROLE IF EXISTS "{login}"')


def _conn_json(dsn: str, **override) -> str:
    from tools import devenv

    return json.dumps({**json.loads(devenv.airflow_connection(dsn)), **override})


def test_an_unreachable_job_database_gives_a_clear_message(api, news_db, monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_NEWS_DB", _conn_json(news_db.dsn, port=free_port()))
    monkeypatch.delenv("AIRFLOW_CONN_NEWS_DB_READONLY", raising=False)
    news = jobs(api)[NEWS]
    assert news["state"] == "unreachable"
    assert news["message"].startswith("job database unreachable: cannot connect to the database")
    assert "'news_db'" in news["message"]
    assert "sweeps" not in news and "nights" not in news
    page = api.get("/pin-nightly/", headers=api.token(*ADMIN)).text
    assert "class='alert unreachable'" in page and "job database unreachable" in page


def test_an_older_schema_gives_a_clear_message(api, news_db):
    # before the job's first run (or the DBA's DDL) there is no job state at all
    news_db.q("DROP SCHEMA IF EXISTS pin_nightly CASCADE")
    news = jobs(api)[NEWS]
    assert news["state"] == "schema" and "table pin_nightly.run_log" in news["message"]
    assert_ok(run_dag(NEWS, {"scope": "FullSweep"}))
    # the job-owned tables as a release before the item kind and the range owners left them
    news_db.q("ALTER TABLE pin_nightly.item_error DROP COLUMN item_kind")
    news_db.q("ALTER TABLE pin_nightly.sweep_range DROP COLUMN owner")
    news = jobs(api)[NEWS]
    assert news["state"] == "schema"
    assert "older than this console expects" in news["message"]
    assert "pin_nightly.item_error.item_kind" in news["message"]
    assert "pin_nightly.sweep_range.owner" in news["message"]
    assert "include/sql/schema/pin_nightly.sql" in news["message"]
    news_db.q("DROP TABLE pin_nightly.run_log")
    assert "table pin_nightly.run_log" in jobs(api)[NEWS]["message"]


def test_an_anonymous_request_is_refused(api):
    for path in ("/pin-nightly/", "/pin-nightly/api/jobs"):
        assert api.get(path).status_code == 401
        bad = api.get(path, headers={"Authorization": "Bearer not-a-token"})
        assert bad.status_code in (401, 403)
        assert "pin_nightly" not in bad.text and NEWS not in bad.text


def test_a_user_without_the_dags_permission_sees_nothing_of_them(api, news_db, catalog_db):
    assert_ok(run_dag(NEWS, {"scope": "FullSweep"}))
    # a user the auth manager gives no role: no DAG to read, refused
    for path in ("/pin-nightly/", "/pin-nightly/api/jobs"):
        r = api.get(path, headers=api.token("nobody", None))
        assert r.status_code == 403 and NEWS not in r.text and CATALOG not in r.text
    # a user who may read the news DAG only sees it alone
    only = jobs(api, (NEWS_READER, "viewer"))
    assert list(only) == [NEWS] and only[NEWS]["state"] == "ok"
    page = api.get("/pin-nightly/", headers=api.token(NEWS_READER, "viewer")).text
    assert f"id='{NEWS}'" in page and CATALOG not in page
    # a viewer reads both
    assert set(jobs(api, ("viewer1", "viewer"))) == {NEWS, CATALOG}


def test_the_plugin_registers_the_app_and_the_view():
    from airflow import plugins_manager

    apps, _ = plugins_manager.get_fastapi_plugins()
    assert [a["url_prefix"] for a in apps if a["name"] == "pin-nightly"] == ["/pin-nightly"]
    views, _ = plugins_manager._get_ui_plugins()
    (view,) = [v for v in views if v["name"] == "pin-nightly"]
    assert view["href"] == "/pin-nightly/" and view["destination"] == "nav"


def test_controls_are_given_by_editors_only_and_refused_with_a_reason(api, news_db):
    """Through the app: a user allowed to edit the DAG pauses and resumes an open sweep and
    sets its batch size (the page shows the control and who gave it); a viewer, a user of
    another DAG and an anonymous request are refused, and so are a sweep that is not open, an
    unknown DAG or action and a value out of its param's bounds, each with its reason."""

    from tests.helpers import budget_spent_after_each_batch

    news_db.posts(4, drift_every=1)
    with budget_spent_after_each_batch(news_db):
        s = assert_ok(run_dag(NEWS, {"scope": "FullSweep", "batch_size": 1, "max_ranges": 1}))
    assert s["backlog_remaining"], s
    sweep = news_db.one("SELECT sweep_id FROM pin_nightly.sweep WHERE status = 'open'")
    url = f"/pin-nightly/api/sweeps/{NEWS}/{sweep}"
    admin = api.token(*ADMIN)

    def post(action, who=admin, body=None):
        headers = with_csrf(api, who) if who else who
        return api.post(f"{url}/{action}", headers=headers, json=body or {})

    assert post("pause", who={}).status_code == 401
    for who in (api.token("viewer1", "viewer"), api.token(NEWS_READER, "viewer")):
        r = post("pause", who=who)
        assert r.status_code == 403 and "may not edit" in r.json()["detail"]
    viewer_page = api.get("/pin-nightly/", headers=api.token("viewer1", "viewer")).text
    assert "form class='control'" not in viewer_page
    assert news_db.q("SELECT * FROM pin_nightly.control_event") == []

    r = post("pause")
    assert r.status_code == 200 and r.json()["control"]["paused"] is True, r.text
    page = api.get("/pin-nightly/", headers=admin).text
    assert "paused</b> by admin" in page and "value='resume'" in page
    r = post("settings", body={"settings": {"batch_size": 3}})
    assert r.status_code == 200 and r.json()["control"]["settings"] == {"batch_size": 3}
    r = post("settings", body={"settings": {"batch_size": 0}})
    assert r.status_code == 422 and "batch_size" in r.json()["detail"]
    assert post("halt").status_code == 422
    other = f"/pin-nightly/api/sweeps/other_dag/{sweep}/pause"
    assert api.post(other, headers=with_csrf(api, admin), json={}).status_code == 404
    assert post("resume").status_code == 200
    assert news_db.q(
        "SELECT action, given_by FROM pin_nightly.control_event ORDER BY given_at"
    ) == [("pause", "admin"), ("settings", "admin"), ("resume", "admin")]
    # the sweep finished: closed to controls
    assert_ok(run_dag(NEWS, {"scope": "FullSweep", "batch_size": 10, "max_ranges": 1}))
    r = post("pause")
    assert r.status_code == 409 and "not open" in r.json()["detail"]


FOREIGN = "http://127.0.0.1:8081"  # the origin of a page on another port of the host
REASONS = {415: "Unsupported Media Type", 403: "Forbidden", 422: "not a JSON object"}
CONTROL_ROW = (
    "SELECT paused, settings, updated_by, updated_at FROM pin_nightly.sweep_control "
    "WHERE sweep_id = %s"
)


def forged_requests(api, client, token: str) -> dict[str, tuple[int, dict]]:
    """What another site's page sends (or a request lacking what the console's page sends)
    through ``client``, the admin's browser holding ``token``: each with the status it gets."""
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    from pin_nightly import console

    own = {"Origin": "http://testserver", "X-CSRF-Token": token}
    admin2 = SimpleAuthManagerUser(username="admin2", role="admin")
    other_user = console.csrf_token(admin2, client.cookies[console.CSRF_COOKIE])
    as_json = {"Content-Type": "application/json"}
    return {
        "a cross-site form": (415, {"data": {"action": "resume"}}),
        "a multipart form": (415, {"files": {"action": (None, "resume")}}),
        "a no-cors fetch": (415, {"content": b"{}", "headers": {"Content-Type": "text/plain"}}),
        "a form with the token": (415, {"data": {"a": "b"}, "headers": {"X-CSRF-Token": token}}),
        "a foreign Origin": (403, {"json": {}, "headers": {**own, "Origin": FOREIGN}}),
        "an opaque Origin": (403, {"json": {}, "headers": {**own, "Origin": "null"}}),
        "a foreign Referer": (
            403,
            {"json": {}, "headers": {"X-CSRF-Token": token, "Referer": f"{FOREIGN}/a.html"}},
        ),
        "no token": (403, {"json": {}, "headers": {"Origin": "http://testserver"}}),
        "a wrong token": (403, {"json": {}, "headers": {**own, "X-CSRF-Token": "0" * 64}}),
        "another session's token": (
            403,
            {"json": {}, "headers": {"X-CSRF-Token": browser(api)[1]}},
        ),
        "another user's token": (403, {"json": {}, "headers": {"X-CSRF-Token": other_user}}),
        "a body that is no object": (422, {"content": b"[]", "headers": {**own, **as_json}}),
    }


def test_no_other_page_can_steer_a_sweep(api, news_db):
    """CSRF, over HTTP as a browser sends it (the UI's session cookie): a control needs a JSON
    body, the page's CSRF token and, where the request names one, the console's own origin. A
    forged form (urlencoded or multipart, the cookie only), a no-cors fetch (text/plain), a
    foreign Origin or Referer with a valid token, a missing or wrong token, another session's
    or another user's token are each refused with a plain reason, and the paused sweep's
    control row is unchanged; the page's own request resumes it."""
    from tests.helpers import budget_spent_after_each_batch

    news_db.posts(4, drift_every=1)
    with budget_spent_after_each_batch(news_db):
        assert_ok(run_dag(NEWS, {"scope": "FullSweep", "batch_size": 1, "max_ranges": 1}))
    sweep = news_db.one("SELECT sweep_id FROM pin_nightly.sweep WHERE status = 'open'")
    url = f"/pin-nightly/api/sweeps/{NEWS}/{sweep}"
    client, token = browser(api)
    own = {"Origin": "http://testserver", "X-CSRF-Token": token}
    r = client.post(f"{url}/pause", headers=own, json={})
    assert r.status_code == 200 and r.json()["control"]["paused"] is True, r.text
    paused = news_db.q(CONTROL_ROW, sweep)
    assert paused[0][:3] == (True, {}, "admin")

    for what, (status, request) in forged_requests(api, client, token).items():
        r = client.post(f"{url}/resume", **request)
        assert r.status_code == status, (what, r.status_code, r.text)
        assert REASONS[status] in r.json()["detail"], (what, r.text)
        assert news_db.q(CONTROL_ROW, sweep) == paused, what
    # the token alone, without the browser session's nonce cookie: refused as well
    r = api.post(f"{url}/resume", headers={**api.token(*ADMIN), "X-CSRF-Token": token}, json={})
    assert r.status_code == 403 and "CSRF token" in r.json()["detail"]
    assert news_db.q(CONTROL_ROW, sweep) == paused
    events = "SELECT action FROM pin_nightly.control_event WHERE sweep_id = %s"
    assert news_db.q(events, sweep) == [("pause",)]

    # the page's own request (JSON with a charset, the token, its origin) resumes the sweep
    headers = {**own, "Content-Type": "application/json; charset=utf-8"}
    r = client.post(f"{url}/resume", headers=headers, content=b"{}")
    assert r.status_code == 200 and r.json()["control"]["paused"] is False, r.text
    assert news_db.q(CONTROL_ROW, sweep)[0][:3] == (False, {}, "admin")


def test_the_page_sends_its_csrf_token_and_keeps_its_session_nonce(api):
    """The page embeds a token of the browser session's nonce (an HttpOnly cookie for the
    console's path, set once), and its controls send it in the header the console checks."""
    from pin_nightly import console

    client, token = browser(api)
    (cookie,) = [c for c in client.cookies.jar if c.name == console.CSRF_COOKIE]
    assert cookie.path == "/pin-nightly" and cookie.has_nonstandard_attr("HttpOnly")
    again = client.get("/pin-nightly/")
    assert console.CSRF_COOKIE not in again.headers.get("set-cookie", "")
    assert csrf(again.text) == token
    assert "'X-CSRF-Token': csrf" in again.text


def test_a_task_process_loads_the_plugin_without_building_the_console():
    """Every task process loads the plugin (for the run notes' listener): the console's
    FastAPI app, and FastAPI with it, are built when the API server serves the first request."""
    import subprocess
    import sys

    code = (
        "import sys; from airflow.sdk.listener import get_listener_manager; "
        "get_listener_manager(); "
        "print('loaded:', *[m for m in ('pin_nightly_plugin', 'fastapi') if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = [line.split()[1:] for line in out.stdout.splitlines() if line.startswith("loaded:")]
    assert loaded == [["pin_nightly_plugin"]], out.stdout[-2000:]
