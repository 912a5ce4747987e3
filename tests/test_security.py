"""Least privilege and hygiene.

- Both DAGs run to a correct result as login users that hold only the roles of
  include/sql/schema/roles.sql, and those users cannot do what the jobs must not do.
- No credentials in the repository; no SQL built from values on the Python side.
- Every request of the console that changes state goes through its CSRF checks (what they
  refuse: tests/test_console.py and tests/test_browser.py).
"""

from __future__ import annotations

import re
import subprocess
import sys
from datetime import date, timedelta
from decimal import Decimal
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from tests import conftest
from tests.helpers import assert_ok, run_night
from tools.devenv import REPO, admin_dsn, airflow_connection, run_sql_file
from tools.rundag import run_dag

D = date(2026, 8, 31)  # a Monday: the catalog runs are of that night, the job's clock set to it
SUFFIX = re.sub(r"\W", "_", conftest.SUFFIX).lower()
INSUFFICIENT_PRIVILEGE = "42501"
# the group roles are cluster-wide: one worker creates and drops them
pytestmark = pytest.mark.xdist_group("roles")


def _login_role(group: str) -> str:
    """A LOGIN user member of ``group`` (cluster-wide: named per test session)."""
    login = f"{group}_login{SUFFIX}"
    with psycopg.connect(admin_dsn(), autocommit=True) as conn:
        conn.execute(f'DROP ROLE IF EXISTS "{login}"')
        # trust authentication on the embedded server's socket: no password is needed (and
        # none is written anywhere); a real deployment sets one, see roles.sql
        conn.execute(
            f'CREATE ROLE "{login}" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE IN ROLE {group}'
        )
    return login


def _drop_role(login: str) -> None:
    with psycopg.connect(admin_dsn(), autocommit=True) as conn:
        conn.execute(f'DROP ROLE IF EXISTS "{login}"')


def _setup_as_dba(dsn: str, *ddl: str) -> None:
    for f in ("schema/pin_nightly.sql", *ddl, "schema/roles.sql"):
        run_sql_file(dsn, f)


def _denied(conn, statement: str, *params) -> None:
    """``statement`` fails with insufficient_privilege (and changes nothing)."""
    try:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(statement, params or None)
    finally:
        conn.rollback()


def _allowed(conn, statement: str, *params) -> None:
    try:
        conn.execute(statement, params or None)
    finally:
        conn.rollback()


def _grants(dsn: str, role: str) -> dict[str, str]:
    """Every privilege ``role`` holds on a table, sequence, column or schema of this database."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT n.nspname || '.' || c.relname, a.privilege_type "
            "  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace, "
            "       aclexplode(c.relacl) a WHERE a.grantee = %(r)s::regrole "
            "UNION ALL "
            "SELECT n.nspname || '.' || c.relname || '.' || t.attname, a.privilege_type "
            "  FROM pg_attribute t JOIN pg_class c ON c.oid = t.attrelid "
            "  JOIN pg_namespace n ON n.oid = c.relnamespace, aclexplode(t.attacl) a "
            " WHERE a.grantee = %(r)s::regrole "
            "UNION ALL "
            "SELECT n.nspname, a.privilege_type FROM pg_namespace n, aclexplode(n.nspacl) a "
            " WHERE a.grantee = %(r)s::regrole",
            {"r": role},
        ).fetchall()
    out: dict[str, list[str]] = {}
    for obj, priv in rows:
        out.setdefault(obj, []).append(priv)
    return {k: ",".join(sorted(v)) for k, v in out.items()}


JOB_STATE = {
    "pin_nightly": "USAGE",
    "pin_nightly.job_lease": "DELETE,INSERT,SELECT,UPDATE",
    "pin_nightly.sweep": "DELETE,INSERT,SELECT,UPDATE",
    "pin_nightly.sweep_range": "DELETE,INSERT,SELECT,UPDATE",
    "pin_nightly.run_log": "DELETE,INSERT,SELECT,UPDATE",
    "pin_nightly.item_error": "DELETE,INSERT,SELECT",
    "pin_nightly.run_signal": "DELETE,INSERT,SELECT",
    "pin_nightly.sweep_control": "INSERT,SELECT,UPDATE",
    "pin_nightly.control_event": "INSERT,SELECT",
    "pin_nightly.lease_token_seq": "USAGE",
    "pin_nightly.sweep_sweep_id_seq": "USAGE",
}


@pytest.fixture
def news_job(news_db, monkeypatch):
    """news_db as the DBA leaves it (job tables + roles.sql) and the job's connection as a
    login user holding only pin_news_job."""
    _setup_as_dba(news_db.dsn)
    login = _login_role("pin_news_job")
    dsn = make_conninfo(news_db.dsn, user=login)
    monkeypatch.setenv("AIRFLOW_CONN_NEWS_DB", airflow_connection(dsn))
    yield news_db, dsn
    _drop_role(login)


@pytest.fixture
def catalog_job(catalog_db, monkeypatch):
    _setup_as_dba(catalog_db.dsn, "schema/catalog_popularity.sql")
    login = _login_role("pin_catalog_job")
    dsn = make_conninfo(catalog_db.dsn, user=login)
    monkeypatch.setenv("AIRFLOW_CONN_CATALOG_DB", airflow_connection(dsn))
    yield catalog_db, dsn
    _drop_role(login)


def test_news_role_holds_exactly_the_minimal_grants(news_job):
    db, dsn = news_job
    expected = {
        **JOB_STATE,
        "news": "USAGE",
        "news.posts": "SELECT",
        "news.comments": "SELECT",
        "news.posts.comments_count": "UPDATE",
        "news.posts.updated_at": "UPDATE",
        "pin_nightly.news_drift": "DELETE,INSERT,SELECT",
        "pin_nightly.news_window_candidate": "DELETE,INSERT,SELECT",
        "pin_nightly.news_skipped_post": "DELETE,INSERT,SELECT,UPDATE",
    }
    assert _grants(db.dsn, "pin_news_job") == expected
    assert db.q("SELECT rolcanlogin FROM pg_roles WHERE rolname = 'pin_news_job'") == [(False,)]
    # roles.sql is idempotent: applied again, the same grants
    run_sql_file(db.dsn, "schema/roles.sql")
    assert _grants(db.dsn, "pin_news_job") == expected


def test_news_dag_runs_as_the_job_role_and_the_role_cannot_do_more(news_job):
    db, dsn = news_job
    drifted = db.post(count=5, visible=3)
    right = db.post(count=2, visible=2)
    locked = db.post(count=9, visible=1)
    # the hot path holds one post: the run records it as skipped (news_skipped_post) ...
    hot_path = psycopg.connect(db.dsn)
    hot_path.execute("SELECT 1 FROM news.posts WHERE id = %s FOR UPDATE", (locked,))
    try:
        s = assert_ok(run_dag("news_comment_reconcile", {"scope": "FullSweep"}))
    finally:
        hot_path.rollback()
        hot_path.close()
    assert (db.count(drifted), db.count(right), db.count(locked)) == (3, 2, 9)
    assert s["drift_corrected"] == 1 and s["posts_skipped_locked"] == 1
    # ... and the next DailyWindow takes it (window candidates, skipped-post cleanup)
    s = assert_ok(run_dag("news_comment_reconcile", {"scope": "DailyWindow"}))
    assert db.count(locked) == 1 and s["drift_corrected"] == 1
    # the run really was the job role's
    assert db.one("SELECT count(*) FROM pin_nightly.sweep") == 2
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT current_user").fetchone()[0].startswith("pin_news_job_login")
        assert not conn.execute(
            "SELECT rolsuper FROM pg_roles WHERE rolname = current_user"
        ).fetchone()[0]
        _allowed(
            conn,
            "UPDATE news.posts SET comments_count = comments_count, "
            "updated_at = updated_at WHERE id = %s",
            right,
        )
        _allowed(conn, "SELECT id FROM news.posts FOR UPDATE")
        _denied(conn, "UPDATE news.posts SET status = 'Archived' WHERE id = %s", right)
        _denied(conn, "UPDATE news.posts SET id = id WHERE id = %s", right)
        _denied(conn, "INSERT INTO news.posts (id, status) VALUES (gen_random_uuid(), 'x')")
        _denied(conn, "DELETE FROM news.posts")
        _denied(conn, "TRUNCATE news.posts")
        _denied(conn, "UPDATE news.comments SET status = 'Visible'")
        _denied(conn, "DELETE FROM news.comments")
        _denied(conn, "SELECT id FROM news.comments FOR UPDATE")  # FOR UPDATE needs UPDATE
        _denied(conn, "ALTER TABLE news.posts ADD COLUMN x int")
        _denied(conn, "CREATE TABLE pin_nightly.x (id int)")
        _denied(conn, "CREATE SCHEMA pin_x")
        _denied(conn, "DROP TABLE pin_nightly.job_lease")
        _denied(conn, "TRUNCATE pin_nightly.sweep")
        _denied(conn, "UPDATE pin_nightly.news_drift SET count_to = 0")
    assert db.count(right) == 2 and db.one("SELECT count(*) FROM news.comments") == 6


def test_catalog_role_holds_exactly_the_minimal_grants(catalog_job):
    db, dsn = catalog_job
    assert _grants(db.dsn, "pin_catalog_job") == {
        **JOB_STATE,
        "catalog": "USAGE",
        "catalog.property_object_cards": "SELECT",
        "catalog.project_cards": "SELECT",
        "catalog.property_object_cards.popularity_score": "UPDATE",
        "catalog.property_object_cards.updated_at": "UPDATE",
        "catalog.project_cards.popularity_score": "UPDATE",
        "catalog.project_cards.updated_at": "UPDATE",
        "catalog.popularity_daily_views": "DELETE,INSERT,SELECT,UPDATE",
        "pin_nightly.popularity_inherited": "DELETE,INSERT,SELECT",
        "pin_nightly.popularity_skipped_card": "DELETE,INSERT,SELECT,UPDATE",
    }
    assert db.q("SELECT rolcanlogin FROM pg_roles WHERE rolname = 'pin_catalog_job'") == [(False,)]


def test_catalog_dag_runs_as_the_job_role_and_the_role_cannot_do_more(catalog_job):
    db, dsn = catalog_job
    a = db.card(views=135)
    p = db.card(views=20, kind="Project")
    for days, views in ((3, 100), (2, 125), (1, 125)):
        db.seed_snapshot(a, D - timedelta(days=days), views)
    db.seed_snapshot(p, D - timedelta(days=1), 5, kind="Project")
    db.seed_snapshot(p, D - timedelta(days=40), 1, kind="Project")  # to be pruned
    s = assert_ok(run_night("catalog_popularity_recompute", {}, D))
    assert db.score(a) == Decimal("30.5084") and db.score(p, "Project") == 15
    assert s["snapshots_written"] == 2 and s["snapshots_pruned"] == 1
    s = assert_ok(run_night("catalog_popularity_recompute", {}, D))
    assert s["property_object_cards_updated"] == 0  # re-run: upserts, nothing changes
    with psycopg.connect(dsn) as conn:
        _allowed(conn, "SELECT id FROM catalog.project_cards FOR UPDATE")
        _denied(conn, "UPDATE catalog.property_object_cards SET popularity_views = 0")
        _denied(conn, "UPDATE catalog.project_cards SET status = 'Delisted'")
        _denied(conn, "INSERT INTO catalog.project_cards (id) VALUES (gen_random_uuid())")
        _denied(conn, "DELETE FROM catalog.property_object_cards")
        _denied(conn, "TRUNCATE catalog.popularity_daily_views")
        _denied(conn, "DROP TABLE catalog.popularity_daily_views")
        _denied(conn, "CREATE TABLE catalog.x (id int)")
    assert db.one("SELECT popularity_views FROM catalog.property_object_cards") == 135


def test_missing_job_tables_are_reported_not_created_by_the_job_role(news_job, capfd, caplog):
    """The job role cannot create the job-owned schema: the run fails at acquire_lease and says
    which file the DBA has to apply."""
    db, dsn = news_job
    drifted = db.post(count=5, visible=3)
    db.q("DROP SCHEMA pin_nightly CASCADE")
    capfd.readouterr()
    r = run_dag("news_comment_reconcile", {"scope": "FullSweep"})
    out = capfd.readouterr()
    text = out.out + out.err + caplog.text
    assert r["state"] == "failed" and r["tasks"]["acquire_lease"] == "failed"
    assert (
        "job-owned tables are missing or out of date (pin_nightly.control_event_sweep does not "
        "exist) and this role may not change them: a DBA applies "
        "include/sql/schema/pin_nightly.sql"
    ) in text
    assert db.count(drifted) == 5
    assert db.one("SELECT to_regnamespace('pin_nightly') IS NULL")


# --- no credentials in the repository -----------------------------------------------------------


def _repository_files() -> list[str]:
    """Tracked files and new files not ignored (what the next commit may contain)."""
    proc = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"not a git work tree: {proc.stderr.decode().strip()}")
    return [n for n in proc.stdout.decode().split("\0") if n and (REPO / n).is_file()]


def test_no_credentials_in_the_repository():
    """detect-secrets finds nothing that is not in the audited baseline (.secrets.baseline:
    documentation examples such as a local DSN; refresh it with
    ``detect-secrets scan --baseline .secrets.baseline`` and audit new entries)."""
    import json

    from detect_secrets import SecretsCollection
    from detect_secrets.settings import transient_settings

    files = _repository_files()
    assert ".env.example" in files and len(files) > 50
    known = json.loads((REPO / ".secrets.baseline").read_text())
    audited = {(f, s["hashed_secret"]) for f, found in known["results"].items() for s in found}
    collection = SecretsCollection(root=str(REPO))
    with transient_settings(known):  # the baseline's plugins and filters
        # file by file in this process: scan_files forks a multiprocessing pool (even of one
        # process), and a fork of the threaded pytest process can deadlock
        for name in files:
            collection.scan_file(name)
    new = sorted(
        f"{name}:{s.line_number}: {s.type}"
        for name, s in collection
        if (name, s.secret_hash) not in audited
    )
    assert new == []
    # .env.example: every secret is an empty value or a change-me placeholder
    env = (REPO / ".env.example").read_text()
    secrets = re.findall(r"(?m)^[A-Z0-9_]*(?:PASSWORD|SECRET|KEY|TOKEN)[A-Z0-9_]*=(.*)$", env)
    assert secrets and all(v == "" or v.startswith("change-me") for v in secrets), secrets


# --- SQL: bound parameters only -----------------------------------------------------------------

SQL_DIRS = ("news", "catalog", "common", "console")
# Text placeholders substituted on the Python side, and what may be substituted: table names
# from the constant catalog.KINDS and the workers' constant ``writes`` (``{item_table}``),
# keyset source queries read from include/sql, the uuid v7 expression of
# include/sql/common/uuid7_now.sql; and fragments ``{<directory>/<name>}``, SQL of include/sql
# itself that pin_nightly.db.sql puts in place (it must exist).
TEXT_PLACEHOLDERS = {"{cards}", "{item_table}", "{source}", "{uuid7_now}"}
FRAGMENT = re.compile(r"\{(\w+/\w+)\}")


def _is_fragment(placeholder: str) -> bool:
    from pin_nightly.db import sql

    m = FRAGMENT.fullmatch(placeholder)
    try:
        return bool(m) and bool(sql(m[1]).strip())
    except FileNotFoundError:
        return False


def sql_file_problems(text: str) -> list[str]:
    """Anything in a job SQL file that is not a bound parameter or a reviewed placeholder."""
    code = "\n".join(line.split("--", 1)[0] for line in text.splitlines())
    problems = []
    bare = re.sub(r"%%|%\(\w+\)s", "", code)
    for m in re.finditer(r"%", bare):
        problems.append(f"bare or positional %: {bare[m.start() : m.start() + 12]!r}")
    for m in re.finditer(r"\{[^{}]*\}", code):
        if m[0] not in TEXT_PLACEHOLDERS and m[0] != "{}" and not _is_fragment(m[0]):
            problems.append(f"text placeholder {m[0]!r}")
    for literal in code.split("'")[1::2]:  # the insides of the string literals
        if re.search(r"%\(\w+\)s", literal):
            problems.append(f"parameter inside a string literal: {literal!r}")
    return problems


def test_the_sql_file_checks_find_value_formatting():
    assert sql_file_problems("SELECT 1 WHERE id = '%(id)s'")
    assert not sql_file_problems("SELECT 1 WHERE s <> 'A' AND id = %(id)s AND t <> 'B'")
    assert sql_file_problems("SELECT 1 WHERE id = %s AND x LIKE '5%'")
    assert sql_file_problems("SELECT * FROM {table} WHERE id = %(id)s")
    assert sql_file_problems("SELECT {common/no_such_fragment}")
    assert not sql_file_problems("SELECT {common/share_deadline} <= now()")
    assert not sql_file_problems(
        "SELECT * FROM {cards} WHERE id = %(id)s AND rn %% 2 = 0 "
        "-- 100% of it\n AND ids = coalesce(x, '{}')"
    )


def test_job_sql_uses_bound_parameters_only():
    files = [f for d in SQL_DIRS for f in sorted((REPO / "include" / "sql" / d).glob("*.sql"))]
    assert len(files) > 20
    problems = {
        f.relative_to(REPO).as_posix(): p for f in files if (p := sql_file_problems(f.read_text()))
    }
    assert problems == {}
    # every text placeholder is one of the reviewed ones, in the files that expect it
    for f in files:
        for ph in set(re.findall(r"\{\w+\}", f.read_text())):
            reviewed = {
                ("{cards}", "catalog"),
                ("{item_table}", "common"),
                ("{source}", "common"),
                ("{uuid7_now}", "catalog"),
            }
            assert (ph, f.parent.name) in reviewed, (
                f.name,
                ph,
            )


def test_no_sql_is_built_from_values_in_python():
    """ruff's S608 (bandit's hardcoded SQL expression): no statement of the job code is built
    with f-strings, %, + or .format(); the sample shows the rule is active."""
    ruff = [str(Path(sys.executable).with_name("ruff")), "check", "--select", "S608"]
    sample = 'def f(cur, pid):\n    cur.execute(f"SELECT * FROM t WHERE id = {pid}")\n'
    flagged = subprocess.run([*ruff, "-"], input=sample, capture_output=True, text=True)
    assert flagged.returncode == 1 and "S608" in flagged.stdout, flagged.stdout
    clean = subprocess.run([*ruff, "plugins", "dags"], cwd=REPO, capture_output=True, text=True)
    assert clean.returncode == 0, clean.stdout


def test_table_names_come_only_from_the_constant():
    from pin_nightly import catalog

    assert {k.table for k in catalog.CARD_KINDS} == {
        "catalog.property_object_cards",
        "catalog.project_cards",
    }
    for kind, table in ((k.name, k.table) for k in catalog.CARD_KINDS):
        text = catalog.card_sql("lock", kind)
        assert table in text and "{cards}" not in text
        # the snapshot id expression is a file of the repository, put in whole
        apply = catalog.card_sql("apply", kind)
        assert "{" not in apply.replace("'{}'", "") and "gen_random_uuid()" in apply
    for bad in ("Project; DROP TABLE news.posts", "catalog.project_cards", ""):
        with pytest.raises(KeyError):
            catalog.card_sql("lock", bad)


# --- the console's requests that change state ---------------------------------------------------


def _dependencies(dependant):
    for dep in dependant.dependencies:
        yield dep.call
        yield from _dependencies(dep)


def test_every_state_changing_request_of_the_console_is_checked():
    """Each route of the console's app that is not a GET depends on its CSRF checks
    (console.check_state_change, through ``state_change``), a control added later too; the
    app holds routes only (no mounted app that would bypass them)."""
    from fastapi.routing import APIRoute

    from pin_nightly import console

    app = console.create_app()
    assert all(isinstance(r, APIRoute) for r in app.routes), app.routes
    changing = [r for r in app.routes if r.methods - {"GET", "HEAD"}]
    assert [r.path for r in changing] == ["/api/sweeps/{dag_id}/{sweep_id}/{action}"]
    for route in changing:
        calls = [getattr(c, "__name__", "") for c in _dependencies(route.dependant)]
        assert "state_change" in calls, (route.path, calls)
