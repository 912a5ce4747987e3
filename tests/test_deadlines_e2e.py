"""Deadline (SLA) and drift alerts end to end: a real scheduler, dag-processor, triggerer and
api-server (metadata on PostgreSQL), a local webhook standing in for the alert channel.

The DAGs are paused at creation. The ``no_success_26h`` interval of each DAG is shortened, through
``PIN_<DAG_ID>_STALE_DEADLINE_SECONDS``, so that the deadline of the scheduled run the scheduler
creates on unpause (catchup off: the latest past fire time of the DAG's timetable) falls
``MARGIN`` seconds after the components start. Right after the start, the scheduled news run is
made to fail (its table renamed) and the scheduled popularity run is kept from starting (its pool
at 0 slots); both deadlines then fire, and both alerts must carry the run, its state, a link to
it in the UI and the runbook section. Then manual news runs prove that the drift alert is sent
above the run's ``drift_alert_threshold`` and only then.
"""

from __future__ import annotations

import math
import re
import time
import urllib.request
from urllib.parse import quote

import pendulum
import psycopg
import pytest

from tests import helpers
from tests.conftest import SUFFIX
from tools import devenv
from tools.stack import Stack, free_port, stack_env

pytestmark = pytest.mark.stack  # real Airflow components: make test-all

NEWS, CATALOG = "news_comment_reconcile", "catalog_popularity_recompute"
# From the clock start (the components' launch) to the no_success_26h deadlines of both scheduled
# runs: the components must start and the scheduled news run fail before it. That took 30-35 s on
# the 2-core machine, 85 s while other stacks were starting; MARGIN - 85 s is the slack.
MARGIN = 120
MOVED = "posts_moved_away"


def fire_times(dag_id: str, now: pendulum.DateTime) -> tuple[pendulum.DateTime, pendulum.DateTime]:
    """The DAG's latest fire time at ``now`` (the logical date of the run the scheduler creates
    on unpause, catchup being off) and the next one, from the DAG's own timetable."""
    from airflow.dag_processing.dagbag import DagBag
    from airflow.serialization.encoders import coerce_to_core_timetable

    bag = DagBag(dag_folder=str(devenv.REPO / "dags" / f"{dag_id}.py"), known_pools={dag_id})
    timetable = coerce_to_core_timetable(bag.dags[dag_id].timetable)
    prev = timetable._align_to_prev(now)
    return prev, timetable._get_next(prev)


def runbook_anchors() -> set[str]:
    """GitHub's anchors of docs/runbook.md's headings."""
    text = (devenv.REPO / "docs" / "runbook.md").read_text()
    return {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", text, re.M)
    }


@pytest.fixture(scope="module")
def stack(pg_admin):
    home = devenv.REPO / ".airflow" / f"sla{SUFFIX}"
    news_dsn, _, metadata_dsn, conns = helpers.stack_databases("sla")
    hook = helpers.Webhook()
    port = free_port()
    env = stack_env(
        home,
        metadata_dsn,
        port,
        {
            **conns,
            "AIRFLOW_CONN_PIN_ALERTS": hook.connection(),
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
            # no scheduled run before a test unpauses its DAG
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
            "AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": "True",
        },
    )
    s = Stack(home, env, migrated=True)
    home.mkdir(parents=True, exist_ok=True)
    # the slow part of a start (a minute under load), before the clock starts
    s.prepare()
    while True:
        now = pendulum.now("UTC")
        fires = {dag_id: fire_times(dag_id, now) for dag_id in (NEWS, CATALOG)}
        nearest = min(nxt for _, nxt in fires.values())
        if (nearest - now).total_seconds() > MARGIN + 180:
            break
        # a fire time during the module would change the scheduled runs' logical dates
        time.sleep((nearest - now).total_seconds() + 2)
    for dag_id, (fire, _) in fires.items():
        env[f"PIN_{dag_id.upper()}_STALE_DEADLINE_SECONDS"] = str(
            math.ceil((now - fire).total_seconds()) + MARGIN
        )
    s.fire = {dag_id: fire for dag_id, (fire, _) in fires.items()}
    s.deadline = now.add(seconds=MARGIN)
    s.hook = hook
    s.news = helpers.NewsDB(news_dsn, psycopg.connect(news_dsn, autocommit=True))
    try:
        s.launch()
        s.wait_for_dags([NEWS, CATALOG])
        yield s
    finally:
        for dag_id in (NEWS, CATALOG):
            try:
                set_paused(s, dag_id, True)
            except Exception:  # noqa: BLE001 - the stack may not have started
                pass
        s.stop()
        hook.server.shutdown()
        s.news.conn.close()


def set_paused(stack: Stack, dag_id: str, paused: bool) -> None:
    stack.request("PATCH", f"/api/v2/dags/{dag_id}?update_mask=is_paused", {"is_paused": paused})


def set_slots(stack: Stack, pool: str, slots: int) -> None:
    stack.request(
        "PATCH",
        f"/api/v2/pools/{pool}?update_mask=slots",
        {"pool": pool, "slots": slots, "include_deferred": False},
    )


def scheduled_run(stack: Stack, dag_id: str, timeout: float = 60) -> dict:
    """The DAG's scheduled run, once the scheduler has created it."""

    def find():
        runs = stack.get(f"/api/v2/dags/{dag_id}/dagRuns?limit=100")["dag_runs"]
        return [r for r in runs if r["run_type"] == "scheduled"]

    runs = helpers.wait_for(find, timeout=timeout, poll=0.5, what=f"a scheduled {dag_id} run")
    assert len(runs) == 1, runs
    return runs[0]


def deadline_alert(stack: Stack, dag_id: str) -> dict:
    """The no_success_26h message of ``dag_id``, waiting up to its deadline plus a margin."""
    wait = (stack.deadline - pendulum.now("UTC")).total_seconds() + 120
    hits = stack.hook.wait_for(
        lambda r: (
            r.get("alert") == "deadline_missed"
            and r.get("deadline_alert") == "no_success_26h"
            and r.get("dag_id") == dag_id
        ),
        timeout=max(wait, 120),
    )
    assert len(hits) == 1, hits
    return hits[0]


def assert_links(stack: Stack, msg: dict, dag_id: str, run_id: str, name: str) -> None:
    assert msg["run_url"] == f"{stack.base}/dags/{dag_id}/runs/{quote(run_id, safe='')}"
    with urllib.request.urlopen(msg["run_url"], timeout=30) as resp:  # noqa: S310 - loopback
        assert resp.status == 200
    assert msg["runbook"] == f"docs/runbook.md#{name}"
    assert name in runbook_anchors(), f"docs/runbook.md has no section {name!r}"


def assert_not_started(stack: Stack, dag_id: str, run_id: str) -> None:
    assert stack.run_state(dag_id, run_id) in ("queued", "running")
    states = stack.task_states(dag_id, run_id)
    assert set(states.values()) <= {None, "scheduled"}, states


@pytest.fixture(scope="module")
def scheduled(stack):
    """Both scheduled runs under way, the failing one first: the news table renamed (the run
    fails in acquire_lease), the popularity pool at 0 slots (no task can start)."""
    stack.news.q(f"ALTER TABLE news.posts RENAME TO {MOVED}")
    set_slots(stack, CATALOG, 0)
    set_paused(stack, NEWS, False)
    set_paused(stack, CATALOG, False)
    yield
    stack.news.q(f"ALTER TABLE IF EXISTS news.{MOVED} RENAME TO posts")
    set_slots(stack, CATALOG, 1)


def test_without_a_base_url_the_message_says_so_instead_of_a_link():
    """Where ``[api] base_url`` is not set (this test process), in both configurations."""
    from airflow.configuration import conf as core_conf
    from airflow.sdk.configuration import conf as sdk_conf

    from pin_nightly import alerts, deadlines

    run = {
        "dag_id": NEWS,
        "dag_run_id": "scheduled__2026-01-02T00:00:00+00:00",
        "state": "running",
        "logical_date": "2026-01-02T00:00:00Z",
    }
    for conf in (core_conf, sdk_conf):
        msg = deadlines.describe("run_over_budget", {"dag_run": run}, 2700, alerts.base_url(conf))
        assert msg["run_url"] == alerts.NO_BASE_URL
        assert msg["description"] == (
            "the run had not finished 45 min after it started (its time budget and a margin)"
        )
        assert msg["runbook"] == "docs/runbook.md#run_over_budget"
    assert "run_over_budget" in runbook_anchors()


def test_no_success_deadline_of_a_failed_scheduled_run(stack, scheduled):
    run = scheduled_run(stack, NEWS)
    run_id = run["dag_run_id"]
    assert pendulum.parse(run["logical_date"]) == stack.fire[NEWS]
    try:
        state = stack.wait_run(NEWS, run_id, timeout=300)
    finally:
        stack.news.q(f"ALTER TABLE IF EXISTS news.{MOVED} RENAME TO posts")
    assert state == "failed"
    assert stack.task_states(NEWS, run_id)["acquire_lease"] == "failed"
    end = pendulum.parse(stack.get(f"/api/v2/dags/{NEWS}/dagRuns/{run_id}")["end_date"])
    assert end < stack.deadline, (
        f"the run failed at {end}, after its deadline {stack.deadline}: raise MARGIN"
    )

    msg = deadline_alert(stack, NEWS)
    assert (msg["dag_id"], msg["run_id"], msg["run_state"]) == (NEWS, run_id, "failed")
    assert "had not succeeded" in msg["description"] and "\n" not in msg["description"]
    assert msg["note"] == "the run failed: its data is stale all the same"
    assert msg["logical_date"] == run["logical_date"] and run["logical_date"] in msg["description"]
    assert 0 <= (pendulum.parse(msg["deadline"]) - stack.deadline).total_seconds() < 1
    assert_links(stack, msg, NEWS, run_id, "no_success_26h")


def test_no_success_deadline_of_a_scheduled_run_that_never_started(stack, scheduled):
    run = scheduled_run(stack, CATALOG)
    run_id = run["dag_run_id"]
    assert pendulum.parse(run["logical_date"]) == stack.fire[CATALOG]
    try:
        assert_not_started(stack, CATALOG, run_id)
        msg = deadline_alert(stack, CATALOG)
        assert_not_started(stack, CATALOG, run_id)
    finally:
        set_slots(stack, CATALOG, 1)
    assert msg["dag_id"] == CATALOG and msg["run_id"] == run_id
    assert msg["run_state"] in ("queued", "running")
    assert msg["note"] == "the run had not succeeded by its deadline"
    assert "had not succeeded" in msg["description"]
    assert_links(stack, msg, CATALOG, run_id, "no_success_26h")
    stack.wait_run(CATALOG, run_id, timeout=600, expect="success")
    set_paused(stack, CATALOG, True)


def test_drift_alert_only_above_the_runs_threshold(stack):
    db = stack.news
    set_paused(stack, NEWS, False)  # manual runs of a paused DAG are not scheduled
    sched = scheduled_run(stack, NEWS)
    stack.wait_run(NEWS, sched["dag_run_id"], timeout=300)
    db.q(f"ALTER TABLE IF EXISTS news.{MOVED} RENAME TO posts")
    db.q("TRUNCATE news.posts, news.comments")

    def drift(run_id: str) -> list[dict]:
        return [
            r
            for r in stack.hook.received
            if r.get("alert") == "drift_above_threshold" and r.get("run_id") == run_id
        ]

    try:
        db.posts(4, drift_every=1)
        above = stack.trigger(
            NEWS, {"scope": "FullSweep", "drift_alert_threshold": 3, "max_ranges": 1}
        )
        stack.wait_run(NEWS, above, timeout=300, expect="success")
        # sent by the summary inside the run: it is there once the run succeeded
        [msg] = drift(above)
        assert (msg["dag_id"], msg["run_state"]) == (NEWS, "running")
        assert (msg["drift_corrected"], msg["threshold"]) == (4, 3)
        assert "drift_alert_threshold of 3" in msg["description"]
        assert_links(stack, msg, NEWS, above, "drift_above_threshold")

        db.posts(3, drift_every=1)
        at = stack.trigger(
            NEWS, {"scope": "FullSweep", "drift_alert_threshold": 3, "max_ranges": 1}
        )
        stack.wait_run(NEWS, at, timeout=300, expect="success")
        summary = db.one("SELECT result FROM pin_nightly.run_log WHERE run_id = %s", at)
        assert summary["drift_corrected"] == 3
        assert drift(at) == []
    finally:
        set_paused(stack, NEWS, True)
    assert db.drifted_posts() == 0
