"""The data team's flows in the Airflow UI, in a real browser: Debian's chromium driven by
Playwright against a real stack (scheduler, dag-processor, triggerer and api-server on
LocalExecutor, metadata on PostgreSQL) behind the simple auth manager's login.

Covered: logging in; each DAG's trigger form (every param with its description, bad values
refused with a visible message and no run created); a news FullSweep triggered from the form,
its labelled mapped ranges in the grid and the summary in the XCom view; clearing one failed
mapped range from the UI, which resumes from its cursor; a missed deadline on the run page; the
console's controls, and a page of another port of the host that cannot steer them (CSRF).
Every step leaves a screenshot in ``test-artifacts/browser/`` (in a subfolder named after
``PIN_TEST_ID`` when it is set); the Airflow logs are in ``.airflow/web<PIN_TEST_ID>/``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import psycopg
import pytest

from pin_nightly.sweeps import range_label
from tests import helpers
from tests.conftest import SUFFIX
from tools import devenv
from tools import stack as stacks

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:
    helpers.skip_module(
        "Playwright for Python is not installed (make setup installs it from requirements-dev.txt)"
    )

CHROMIUM = helpers.require_tool("chromium", "the browser test drives Debian's package")

pytestmark = pytest.mark.stack  # real Airflow components: make test-all

NEWS, CATALOG = "news_comment_reconcile", "catalog_popularity_recompute"
USER = "admin"
ARTIFACTS = devenv.REPO / "test-artifacts" / "browser"
RUN_TIMEOUT = 240_000  # ms: a DAG run on a busy 2-core machine
expect.set_options(timeout=30_000)


class LoginStack(stacks.LoginStack):
    """The login stack, with what the browser test asks of it."""

    def manual_runs(self, dag_id: str) -> int:
        return self.get(f"/api/v2/dags/{dag_id}/dagRuns?run_type=manual")["total_entries"]


@pytest.fixture(scope="module")
def stack(pg_admin):
    """A real stack whose UI asks for a login: user ``admin`` (role admin) with a password
    generated for this run, written to the simple auth manager's passwords file before start.
    Every news run misses its run budget (2 s), so the run page has a missed deadline."""
    home = devenv.REPO / ".airflow" / f"web{SUFFIX}"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    news_dsn, _, metadata_dsn, conns = helpers.stack_databases("web")
    env = {
        **conns,
        "PIN_NEWS_COMMENT_RECONCILE_RUN_DEADLINE_SECONDS": "2",
        # unpaused below, once the api-server answers: a task queued before it listens fails
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
    }
    s = stacks.login_stack(home, metadata_dsn, env, USER, cls=LoginStack, migrated=True)
    try:
        s.start()
        s.wait_for_dags([NEWS, CATALOG])
        for dag_id in (NEWS, CATALOG):
            s.request("PATCH", f"/api/v2/dags/{dag_id}?update_mask=is_paused", {"is_paused": False})
        s.news = helpers.NewsDB(news_dsn, psycopg.connect(news_dsn, autocommit=True))
        yield s
    finally:
        s.stop()
        if hasattr(s, "news"):
            s.news.conn.close()


@pytest.fixture(scope="module")
def dag_params() -> dict[str, dict]:
    """Each DAG's params as the DAG files declare them."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(devenv.REPO / "dags"))
    assert bag.import_errors == {}
    return {
        dag_id: {k: bag.dags[dag_id].params.get_param(k) for k in bag.dags[dag_id].params}
        for dag_id in (NEWS, CATALOG)
    }


class Shots:
    """Numbered screenshots of every step, in test-artifacts/browser/."""

    def __init__(self, folder: Path):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        self.folder, self.n = folder, 0

    def __call__(self, page, name: str) -> None:
        self.n += 1
        page.screenshot(path=str(self.folder / f"{self.n:02d}-{name}.png"))


@pytest.fixture(scope="module")
def shots() -> Shots:
    return Shots(ARTIFACTS / SUFFIX.lstrip("_") if SUFFIX else ARTIFACTS)


@pytest.fixture(scope="module")
def browser():
    args = ["--disable-dev-shm-usage"] + (["--no-sandbox"] if os.geteuid() == 0 else [])
    pw = sync_playwright().start()
    try:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
        try:
            yield b
        finally:
            b.close()
    finally:
        pw.stop()


def _new_page(browser, stack):
    context = browser.new_context(base_url=stack.base, viewport={"width": 1600, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(30_000)
    return context, page


def sign_in(page, username: str, password: str) -> None:
    """Fill in and send the simple auth manager's login form."""
    expect(page.get_by_role("heading", name="Sign into Airflow")).to_be_visible()
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Sign in").click()


def log_in(page, stack) -> None:
    page.goto("/")
    sign_in(page, stack.username, stack.password)
    expect(page.get_by_role("heading", name="Welcome")).to_be_visible()


@pytest.fixture(scope="module")
def ui(browser, stack):
    """One logged-in browser page for the flows."""
    context, page = _new_page(browser, stack)
    log_in(page, stack)
    yield page
    context.close()


@pytest.fixture
def page(ui, shots, request):
    yield ui
    name = re.sub(r"[^\w-]+", "-", request.node.name.removeprefix("test_"))[:70].strip("-")
    shots(ui, f"{name}-end")


# --- UI pieces -------------------------------------------------------------------------------


def run_url(dag_id: str, run_id: str, rest: str = "") -> str:
    return f"/dags/{dag_id}/runs/{quote(run_id)}{rest}"


def run_state_badge(page, run_id: str):
    """The state badge next to the run's heading on the run page."""
    return (
        page.get_by_role("heading", name=run_id, exact=True)
        .locator("xpath=..")
        .get_by_test_id("state-badge")
    )


def click_grid_cell(page, run_id: str, task: str) -> None:
    """Click the grid's cell of ``task`` in the run's column (a mapped task: its mapped list).
    The pointer first leaves the grid: the tooltip of the cell it rests on can cover others."""
    page.mouse.move(0, 0)
    page.locator(
        f'a[href$="/runs/{run_id}/tasks/{task}"], a[href$="/runs/{run_id}/tasks/{task}/mapped"]'
    ).first.click()


def open_mapped_list(page, run_id: str, task: str, count: int) -> None:
    """From the run page's grid, the list of the mapped task's instances in the run."""
    click_grid_cell(page, run_id, task)
    expect(page).to_have_url(re.compile(rf"/tasks/{task}/mapped$"))
    expect(page.get_by_role("heading", name=f"{count} Task Instances")).to_be_visible()


def open_clear_dialog(page, task: str):
    """Open the task instance page's Clear dialog and wait for its list of affected task
    instances to show, and to stay. On a busy machine Airflow 3.3's task instance page can
    close the dialog on its own right after it opens (its header re-renders while the page's
    queries refetch): like a person, the test opens it again."""
    dialog = page.get_by_role("dialog").filter(
        has=page.get_by_role("heading", name=re.compile(r"Clear Task Instance"))
    )
    rows = dialog.get_by_role("row").filter(has_text=task)
    for _ in range(3):
        expect(dialog).to_have_count(0)
        page.get_by_role("button", name="Press shift+c to clear").click()
        try:
            expect(rows).to_have_count(1, timeout=10_000)
            page.wait_for_timeout(2_000)  # the refetches that close it follow its dry run
            expect(rows).to_have_count(1, timeout=1_000)
            return dialog
        except AssertionError:
            print("the Clear dialog closed on its own or showed no task instances: again")
            page.keyboard.press("Escape")
    expect(rows).to_have_count(1)
    return dialog


def open_trigger_form(page, dag_id: str):
    page.goto(f"/dags/{dag_id}")
    page.get_by_role("button", name="Trigger Dag").click()
    form = page.get_by_role("dialog").filter(has=page.get_by_role("heading", name="Trigger Dag"))
    expect(form).to_be_visible()
    return form


def field(form, name: str):
    """A param's row in the trigger form: its label, input and description."""
    return form.get_by_role("group").filter(has=form.page.locator(f'[name="element_{name}"]'))


def ui_text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, bool) or value is None else str(value)


# --- the flows -------------------------------------------------------------------------------


def test_login_with_the_configured_user(browser, stack, shots):
    context, page = _new_page(browser, stack)
    try:
        page.goto("/")
        expect(page).to_have_url(re.compile(r"/auth/login"))
        expect(page.get_by_role("heading", name="Sign into Airflow")).to_be_visible()
        shots(page, "login-page")
        sign_in(page, stack.username, stack.password + "-wrong")
        expect(page.get_by_text("Invalid credentials")).to_be_visible()
        expect(page).to_have_url(re.compile(r"/auth/login"))
        shots(page, "login-refused")
        sign_in(page, stack.username, stack.password)
        expect(page.get_by_role("heading", name="Welcome")).to_be_visible()
        expect(page).to_have_url(stack.base + "/")
        shots(page, "logged-in")
        page.goto("/dags")
        for dag_id in (NEWS, CATALOG):
            expect(page.get_by_role("link", name=dag_id, exact=True)).to_be_visible()
        shots(page, "dag-list")
    finally:
        context.close()


@pytest.mark.parametrize("dag_id", [NEWS, CATALOG])
def test_trigger_form_shows_every_param_and_refuses_bad_values(
    page, stack, shots, dag_params, dag_id
):
    params = dag_params[dag_id]
    runs_before = stack.manual_runs(dag_id)
    form = open_trigger_form(page, dag_id)
    # every param and nothing else, each with its description and default
    names = form.locator('[name^="element_"]').evaluate_all("els => els.map(e => e.name)")
    assert sorted(names) == sorted(f"element_{k}" for k in params)
    for name, param in params.items():
        assert param.description, f"{dag_id}: param {name} has no description"
        row = field(form, name)
        expect(row).to_have_count(1)
        expect(row.locator("label").first).to_contain_text(name)
        expect(row.locator('[id$="::helper-text"]')).to_have_text(param.description)
        if isinstance(param.value, (int, float, str)) and not isinstance(param.value, bool):
            expect(form.locator(f'[name="element_{name}"]')).to_have_value(str(param.value))
        if "enum" in param.schema:  # a select of exactly the allowed values: no wrong one
            select = form.get_by_role("combobox", name=name)
            select.click()
            expect(page.get_by_role("option")).to_have_text([str(v) for v in param.schema["enum"]])
            shots(page, f"{dag_id}-form-{name}-options")
            wrong = "Weekly"
            assert wrong not in param.schema["enum"]
            select.fill(wrong)
            expect(page.get_by_role("option")).to_have_count(0)
            expect(page.get_by_text("No options", exact=True)).to_be_visible()
            shots(page, f"{dag_id}-form-{name}-no-wrong-value")
            select.fill("")
            page.get_by_role("option", name=str(param.value), exact=True).click()
            expect(form.locator(f'[name="element_{name}"]')).to_have_value(str(param.value))
    shots(page, f"{dag_id}-form")

    # an integer below its minimum: the number field puts it back to the bound
    name, schema = next(
        (k, p.schema)
        for k, p in params.items()
        if p.schema.get("type") == "integer" and "minimum" in p.schema
    )
    box = form.locator(f'[name="element_{name}"]')
    box.fill(str(schema["minimum"] - 1))
    box.press("Tab")
    expect(box).to_have_value(str(schema["minimum"]))
    box.fill(str(params[name].value))

    # a number not above its exclusive minimum: refused by the schema, shown in the form
    name, schema = next((k, p.schema) for k, p in params.items() if "exclusiveMinimum" in p.schema)
    box = form.locator(f'[name="element_{name}"]')
    box.fill(str(schema["exclusiveMinimum"]))
    box.press("Tab")
    form.get_by_test_id("trigger-dag-submit").click()
    error = form.get_by_text(f"Invalid input for param {name}")
    expect(error).to_be_visible()
    expect(error).to_contain_text("less than or equal to the minimum")
    expect(page.get_by_text("Failed to Trigger Dag").first).to_be_visible()
    error.scroll_into_view_if_needed()
    shots(page, f"{dag_id}-form-refused-{name}")
    box.fill(str(params[name].value))
    box.press("Tab")

    # a malformed uuid in the id list: refused with the pattern
    name = next(k for k, p in params.items() if p.schema.get("items", {}).get("pattern"))
    form.locator(f'[name="element_{name}"]').fill("not-a-uuid")
    form.get_by_test_id("trigger-dag-submit").click()
    error = form.get_by_text(f"Invalid input for param {name}")
    expect(error).to_be_visible()
    expect(error).to_contain_text("'not-a-uuid' does not match")
    error.scroll_into_view_if_needed()
    shots(page, f"{dag_id}-form-refused-{name}")

    form.get_by_role("button", name="Close").click()
    expect(form).to_be_hidden()
    assert stack.manual_runs(dag_id) == runs_before


@pytest.fixture(scope="module")
def sweep_run(ui, stack, shots) -> str:
    """A news FullSweep of 60 drifted posts in 3 ranges, triggered from the form; ends green."""
    page = ui
    db = stack.news
    stack.wait_idle([NEWS, CATALOG])
    db.q("TRUNCATE news.posts, news.comments")
    db.posts(60, drift_every=1)
    form = open_trigger_form(page, NEWS)
    form.get_by_role("combobox", name="scope").click()
    page.get_by_role("option", name="FullSweep", exact=True).click()
    form.locator('[name="element_batch_size"]').fill("5")
    form.locator('[name="element_max_ranges"]').fill("3")
    shots(page, "news-fullsweep-form")
    form.get_by_test_id("trigger-dag-submit").click()
    expect(page).to_have_url(re.compile(rf"/dags/{NEWS}/runs/manual__"))
    run_id = unquote(re.search(r"/runs/([^/?#]+)", page.url)[1])
    shots(page, "news-fullsweep-triggered")
    expect(run_state_badge(page, run_id)).to_have_text("Success", timeout=RUN_TIMEOUT)
    shots(page, "news-fullsweep-success")
    return run_id


def test_fullsweep_from_the_form_shows_labelled_ranges_and_the_summary(
    page, stack, shots, sweep_run
):
    db, run_id = stack.news, sweep_run
    conf = stack.get(f"/api/v2/dags/{NEWS}/dagRuns/{quote(run_id)}")["conf"]
    assert (conf["scope"], conf["batch_size"], conf["max_ranges"]) == ("FullSweep", 5, 3)
    sweep = db.one(
        "SELECT DISTINCT sweep_id FROM pin_nightly.sweep_range WHERE run_id = %s", run_id
    )
    ranges = db.q(
        "SELECT range_no, lower_id::text, upper_id::text FROM pin_nightly.sweep_range "
        "WHERE sweep_id = %s ORDER BY range_no",
        sweep,
    )
    labels = [
        range_label({"prefix": "FullSweep", "range_no": n, "lower_id": lo, "upper_id": hi})
        for n, lo, hi in ranges
    ]
    assert len(labels) == 3

    # the grid's mapped task lists the ranges by their labels
    page.goto(run_url(NEWS, run_id))
    open_mapped_list(page, run_id, "reconcile_range", len(labels))
    for label in labels:
        row = page.get_by_role("row").filter(has=page.get_by_role("link", name=label, exact=True))
        expect(row).to_have_count(1)
        expect(row.get_by_test_id("state-badge")).to_have_text("Success")
    shots(page, "news-fullsweep-mapped-ranges")

    # the summary, as summarize returned it, in its XCom view
    result = db.one("SELECT result FROM pin_nightly.run_log WHERE run_id = %s", run_id)
    assert result["status"] == "success" and result["drift_corrected"] == 60
    click_grid_cell(page, run_id, "summarize")
    page.get_by_role("link", name="Storage").click()
    page.get_by_role("link", name="XCom").click()
    expect(page).to_have_url(re.compile(r"/tasks/summarize/xcom$"))
    for key in ("status", "scope", "posts_reconciled", "drift_corrected", "backlog_remaining"):
        row = page.get_by_role("row").filter(has=page.get_by_role("cell", name=key, exact=True))
        expect(row.get_by_role("cell").nth(2).locator("p")).to_have_text(ui_text(result[key]))
    expect(
        page.get_by_role("row").filter(
            has=page.get_by_role("cell", name="return_value", exact=True)
        )
    ).to_have_count(1)
    shots(page, "news-fullsweep-summary-xcom")
    assert db.drifted_posts() == 0


def test_clearing_one_failed_range_from_the_ui_resumes_it(page, stack, shots):
    db = stack.news
    stack.wait_idle([NEWS, CATALOG])
    db.q("TRUNCATE news.posts, news.comments")
    ids = db.posts(60, drift_every=1)
    poison = ids[45]
    db.fail_updates_of(poison)
    try:
        run_id = stack.trigger(NEWS, {"scope": "FullSweep", "batch_size": 5, "max_ranges": 3})
        page.goto(run_url(NEWS, run_id))
        expect(run_state_badge(page, run_id)).to_have_text("Failed", timeout=RUN_TIMEOUT)
        shots(page, "news-range-failed")
        states = stack.task_states(NEWS, run_id)
        assert states["reconcile_range[2]"] == "failed"
        assert states["reconcile_range[0]"] == states["reconcile_range[1]"] == "success"
        sweep = db.one(
            "SELECT DISTINCT sweep_id FROM pin_nightly.sweep_range WHERE run_id = %s", run_id
        )
        cursor = db.one(
            "SELECT cursor_id::text FROM pin_nightly.sweep_range "
            "WHERE sweep_id = %s AND range_no = 2",
            sweep,
        )
        assert ids[40] <= cursor < poison
    finally:
        db.allow_updates()

    # the failed range in the grid's mapped list, then its task instance, then Clear
    open_mapped_list(page, run_id, "reconcile_range", 3)
    failed = page.get_by_role("row").filter(has_text="FullSweep#2 (")
    expect(failed.get_by_test_id("state-badge")).to_have_text("Failed")
    failed.get_by_role("link", name=re.compile(r"^FullSweep#2 \(")).click()
    expect(page).to_have_url(re.compile(r"/tasks/reconcile_range/mapped/2$"))
    dialog = open_clear_dialog(page, "reconcile_range")
    affected = set()
    for row in dialog.get_by_role("row").all()[1:]:
        cells = row.get_by_role("cell").all_inner_texts()
        affected.add((cells[1].strip(), int(cells[3])))
    shots(page, "news-clear-one-range")
    # that range alone with its downstream tasks (and the lease setup the UI adds to them);
    # neither the other ranges nor the planning
    assert [i for t, i in affected if t == "reconcile_range"] == [2], affected
    tasks = {t for t, _ in affected}
    assert {"summarize", "release_lease"} <= tasks and not tasks & {
        "validate_options",
        "plan_ranges",
    }, affected
    # the dialog closes before the UI's request returns: wait for the request itself, or the
    # navigation below may cancel it
    with page.expect_response(
        lambda r: r.request.method == "POST" and r.url.endswith(f"/dags/{NEWS}/clearTaskInstances")
    ) as cleared:
        dialog.get_by_role("button", name="Confirm").click()
    assert cleared.value.ok, cleared.value.status
    expect(dialog).to_be_hidden()

    page.goto(run_url(NEWS, run_id))
    expect(run_state_badge(page, run_id)).to_have_text("Success", timeout=RUN_TIMEOUT)
    open_mapped_list(page, run_id, "reconcile_range", 3)
    headers = page.get_by_role("columnheader").all_inner_texts()
    try_column = next(i for i, h in enumerate(headers) if "Try Number" in h)
    for n in range(3):  # only the cleared range ran twice
        row = page.get_by_role("row").filter(has_text=f"FullSweep#{n} (")
        expect(row.get_by_test_id("state-badge")).to_have_text("Success")
        expect(row.get_by_role("cell").nth(try_column)).to_have_text("2" if n == 2 else "1")
    shots(page, "news-cleared-range-success")

    tis = stack.get(f"/api/v2/dags/{NEWS}/dagRuns/{quote(run_id)}/taskInstances?limit=100")
    tries = {(t["task_id"], t["map_index"]): t["try_number"] for t in tis["task_instances"]}
    assert tries[("reconcile_range", 2)] == 2
    assert tries[("reconcile_range", 0)] == tries[("reconcile_range", 1)] == 1
    assert tries[("plan_ranges", -1)] == 1
    assert db.rows_per_range(sweep) == [20, 20, 20]  # the range resumed; nothing read twice
    assert db.drifted_posts() == 0
    assert db.q(
        "SELECT count(*), count(DISTINCT post_id) FROM pin_nightly.news_drift WHERE sweep_id = %s",
        sweep,
    ) == [(60, 60)]
    assert db.q("SELECT count(*) FROM pin_nightly.job_lease") == [(0,)]
    summary = db.one("SELECT result FROM pin_nightly.run_log WHERE run_id = %s", run_id)
    assert summary["status"] == "success" and summary["backlog_remaining"] is False


def test_a_missed_deadline_shows_on_the_run_page(page, stack, shots, sweep_run):
    run_id = sweep_run
    deadlines = stack.get(f"/ui/dags/{NEWS}/dagRuns/{quote(run_id)}/deadlines")["deadlines"]
    assert any(d["missed"] and d["alert_name"] == "run_over_budget" for d in deadlines), deadlines
    page.goto(run_url(NEWS, run_id))
    stat = page.get_by_test_id("stat").filter(
        has=page.get_by_role("heading", name="Deadline", exact=True)
    )
    expect(stat).to_contain_text("Missed")
    expect(stat).to_contain_text("run_over_budget")
    expect(stat).to_contain_text(re.compile(r"Finished \d\d:\d\d:\d\d after deadline"))
    shots(page, "news-run-missed-deadline")


def test_the_console_pauses_and_resumes_a_running_sweep(page, browser, stack, shots):
    """Browse > pin-nightly, inside the UI: a FullSweep running slowly (each post update takes
    0.2 s) and held half-way (whatever the machine's speed, it is still running when the page
    pauses it), paused from the page (no batch while paused), resumed, and finished with every
    count exact; the nights' plots and the post a trigger rejects, repaired from the page's
    prefilled repair form; the page refused to a browser that is not logged in."""
    db = stack.news
    stack.wait_idle([NEWS, CATALOG])
    db.q("TRUNCATE news.posts, news.comments")
    ids = db.posts(60, drift_every=1)
    db.fail_updates_of(ids[59], errcode="raise_exception")  # the last one: an item error
    db.slow_updates(0.2)
    db.hold_updates_from(ids[30])
    query = "SELECT coalesce(sum(rows_processed), 0) FROM pin_nightly.sweep_range r "
    query += "JOIN pin_nightly.sweep s USING (sweep_id) WHERE s.run_id = %s"

    def done() -> int:  # the rows the run's range has processed (its first run makes the schema)
        made = db.one("SELECT to_regclass('pin_nightly.sweep_range') IS NOT NULL")
        return db.one(query, run_id) if made else 0

    try:
        conf = {"scope": "FullSweep", "batch_size": 2, "max_ranges": 1}
        run_id = stack.trigger(NEWS, conf)
        # the range is at the held batch before the page pauses it (a fast page must not
        # pause it earlier, short of the batch the test releases below)
        helpers.wait_for(lambda: done() >= 30, timeout=120, poll=0.2)
        page.goto("/plugin/pin-nightly")
        console = page.frame_locator("iframe")
        sweep = console.locator(f"#{NEWS} .sweep").first
        expect(sweep).to_contain_text("FullSweep")
        sweep.get_by_role("button", name="Pause sweep").click()
        expect(console.locator(f"#{NEWS} .sweep").first).to_contain_text("paused by admin")
        shots(page, "console-sweep-paused")
        db.release_updates()  # the batch held ends; the range then waits, paused
        helpers.wait_for(lambda: done() >= 32, timeout=60, poll=0.2)
        paused_at = done()
        time.sleep(8)  # four rechecks: no batch while paused
        assert done() <= paused_at + 2  # at most the batch under way then
        console.locator(f"#{NEWS} .sweep").first.get_by_role("button", name="Resume sweep").click()
        stack.wait_run(NEWS, run_id, timeout=RUN_TIMEOUT / 1000, expect="success")
    finally:
        db.allow_updates()
    assert db.drifted_posts() == 1  # the rejected post, and only it
    summary = db.one("SELECT result FROM pin_nightly.run_log WHERE run_id = %s", run_id)
    assert [c["action"] for c in summary["controls"]] == ["pause", "resume"], summary
    assert summary["posts_reconciled"] == 59 and summary["item_errors"] == 1, summary
    page.goto("/plugin/pin-nightly")
    console = page.frame_locator("iframe")
    expect(console.locator(f"#nights-{NEWS} .plot-container")).to_be_visible()
    errors = console.locator(f"#{NEWS} table.errors")
    expect(errors).to_contain_text(ids[59])
    repair = console.locator(f"#{NEWS} form.repair")
    expect(repair.locator("textarea")).to_have_value(re.compile(ids[59]))
    shots(page, "console")
    # the rule is gone (above): the repair form triggers a targeted run that writes the post
    repair.get_by_role("button", name="Trigger the repair").click()
    expect(repair.locator(".result")).to_contain_text("triggered: ")
    repair_run = repair.locator(".result").inner_text().removeprefix("triggered: ").strip()
    stack.wait_run(NEWS, repair_run, timeout=RUN_TIMEOUT / 1000, expect="success")
    assert db.drifted_posts() == 0
    logged = db.one("SELECT result FROM pin_nightly.run_log WHERE run_id = %s", repair_run)
    assert logged["scope"] == "Targeted" and logged["drift_corrected"] == 1, logged
    # a browser that is not logged in gets no page
    context = browser.new_context(base_url=stack.base)
    try:
        anonymous = context.new_page()
        response = anonymous.goto("/pin-nightly/")
        assert response.status == 401 and NEWS not in anonymous.content()
    finally:
        context.close()


# A page of another origin of the host (another port of 127.0.0.1: the same site, so the UI's
# session cookie goes with its requests) that tries to resume the sweep at URL: a form posted as
# soon as it loads, a JSON fetch (a CORS preflight that the API server does not answer) and a
# no-cors fetch (text/plain, the only body type it may send).
ATTACK_HTML = """<!doctype html><html><body>
<form id='forged' method='post' action='URL' target='sink'>
<input type='hidden' name='action' value='resume'></form>
<iframe name='sink'></iframe><p id='fetches'></p>
<script>
var out = document.getElementById('fetches');
fetch('URL', {method: 'POST', credentials: 'include',
  headers: {'Content-Type': 'application/json'}, body: '{}'})
  .then(function (r) { out.textContent += 'json fetch answered ' + r.status + '; '; },
        function () { out.textContent += 'json fetch blocked; '; })
  .then(function () {
    return fetch('URL', {method: 'POST', mode: 'no-cors', credentials: 'include',
      headers: {'Content-Type': 'text/plain'}, body: '{}'});
  })
  .then(function () { out.textContent += 'no-cors fetch sent'; });
document.getElementById('forged').submit();
</script></body></html>"""


class AttackSite:
    """:data:`ATTACK_HTML` against ``url``, served on a free port of 127.0.0.1."""

    def __init__(self, url: str):
        body = ATTACK_HTML.replace("URL", url).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/attack.html"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def open_sweep_paused_from_the_console(page, stack) -> int:
    """A news FullSweep left open (a slow one, its run's budget spent once two batches are
    done, of twenty), paused from the console's page by the logged-in admin: the sweep's id."""
    db = stack.news
    stack.wait_idle([NEWS, CATALOG])
    db.q("TRUNCATE news.posts, news.comments")
    db.posts(40, drift_every=1)
    db.slow_updates(0.2)
    run_id = stack.trigger(NEWS, {"scope": "FullSweep", "batch_size": 2, "max_ranges": 1})
    query = "SELECT coalesce(sum(rows_processed), 0) FROM pin_nightly.sweep_range r "
    query += "JOIN pin_nightly.sweep s USING (sweep_id) WHERE s.run_id = %s"
    made = "SELECT to_regclass('pin_nightly.sweep_range') IS NOT NULL"
    helpers.wait_for(lambda: db.one(made) and db.one(query, run_id) >= 4, timeout=120, poll=0.2)
    db.q("UPDATE pin_nightly.job_lease SET run_deadline_at = clock_timestamp()")
    stack.wait_run(NEWS, run_id, timeout=RUN_TIMEOUT / 1000, expect="success")
    db.allow_updates()
    (sweep,) = db.q("SELECT sweep_id FROM pin_nightly.sweep WHERE status = 'open'")
    page.goto("/plugin/pin-nightly")
    section = page.frame_locator("iframe").locator(f"#{NEWS} .sweep").first
    section.get_by_role("button", name="Pause sweep").click()
    expect(section).to_contain_text("paused by admin")
    return sweep[0]


def attack(context, resume: str, shots) -> list[tuple[str, int]]:
    """Open :class:`AttackSite` against the control ``resume`` in the browser ``context`` (the
    admin's: the UI's session cookie) until its form is answered and its fetches are done; the
    method and status of each request that reached the control."""
    site = AttackSite(resume)
    attacker = context.new_page()
    posts = []
    attacker.on(
        "response", lambda r: r.url == resume and posts.append((r.request.method, r.status))
    )
    try:
        attacker.goto(site.url)
        expect(attacker.locator("#fetches")).to_have_text("json fetch blocked; no-cors fetch sent")
        sink = attacker.frame_locator("iframe[name=sink]").locator("body")
        expect(sink).to_contain_text("Forbidden: the request comes from another site")
        shots(attacker, "console-csrf-attack-refused")
    finally:
        attacker.close()
        site.close()
    return posts


def test_a_page_of_another_port_cannot_steer_the_console(page, stack, shots):
    """CSRF in a real browser: while the admin is logged in, a page served from another port
    of 127.0.0.1 posts a form to the console's resume control, and tries a JSON fetch and a
    no-cors one. The form and the no-cors fetch reach the console with the admin's session
    cookie and are refused (403, a foreign origin), the JSON fetch is stopped by the browser;
    the paused sweep stays paused, with no control written. The page's own button resumes it."""
    db = stack.news
    try:
        sweep = open_sweep_paused_from_the_console(page, stack)
        shots(page, "console-sweep-paused-before-attack")
        resume = f"{stack.base}/pin-nightly/api/sweeps/{NEWS}/{sweep}/resume"
        posts = attack(page.context, resume, shots)
        assert posts == [("POST", 403), ("POST", 403)], posts  # the admin's, not anonymous (401)
        control = "SELECT paused, updated_by FROM pin_nightly.sweep_control WHERE sweep_id = %s"
        assert db.q(control, sweep) == [(True, "admin")]
        events = "SELECT action FROM pin_nightly.control_event WHERE sweep_id = %s"
        assert db.q(events, sweep) == [("pause",)]

        page.goto("/plugin/pin-nightly")
        section = page.frame_locator("iframe").locator(f"#{NEWS} .sweep").first
        section.get_by_role("button", name="Resume sweep").click()
        expect(section).to_contain_text("Control: running")
        assert db.q(control, sweep) == [(False, "admin")]
        # the sweep run to its end: no open sweep left for another test of the module
        run_id = stack.trigger(NEWS, {"scope": "FullSweep", "batch_size": 10, "max_ranges": 1})
        stack.wait_run(NEWS, run_id, timeout=RUN_TIMEOUT / 1000, expect="success")
        assert db.one("SELECT status FROM pin_nightly.sweep WHERE sweep_id = %s", sweep) == "done"
    finally:
        db.allow_updates()
