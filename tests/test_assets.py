"""The assets other teams schedule on, end to end: a real scheduler runs the consumer DAGs of
tests/dags/asset_consumers.py after a run that completed its work, and not after a dry run, a
targeted run, a run that found the lease held, one that left a backlog or one that failed; the
consumers' ``inlet_events`` carry the extra.

The job DAGs are paused at creation; unpausing them makes the scheduler create the run of their
latest slot, a complete night whatever its date. Assertions are on the events' run ids, so a
slot that passes while the module runs adds a complete night and changes nothing.
"""

from __future__ import annotations

import json
import shutil
from datetime import timedelta
from urllib.parse import quote

import psycopg
import pytest

from tests import helpers
from tests.conftest import SUFFIX
from tools import devenv
from tools.stack import Stack, free_port, stack_env

pytestmark = pytest.mark.stack  # real Airflow components: make test-all

NEWS, CATALOG = "news_comment_reconcile", "catalog_popularity_recompute"
SCORES, COUNTS = "consume_catalog_popularity_scores", "consume_news_comment_counts"


@pytest.fixture(scope="module")
def stack(pg_admin):
    home = devenv.REPO / ".airflow" / f"assets{SUFFIX}"
    dags = home / "dags"
    shutil.rmtree(dags, ignore_errors=True)
    dags.mkdir(parents=True)
    for f in [*(devenv.REPO / "dags").glob("*.py"), devenv.REPO / "tests/dags/asset_consumers.py"]:
        shutil.copy(f, dags / f.name)
    news_dsn, catalog_dsn, metadata_dsn, conns = helpers.stack_databases("assets")
    env = stack_env(
        home,
        metadata_dsn,
        free_port(),
        {
            **conns,
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
            "AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": "True",  # asset-triggered runs
        },
    )
    s = Stack(home, env, migrated=True).start()
    try:
        s.wait_for_dags([NEWS, CATALOG, SCORES, COUNTS])
        s.news = helpers.NewsDB(news_dsn, psycopg.connect(news_dsn, autocommit=True))
        s.catalog = helpers.CatalogDB(catalog_dsn, psycopg.connect(catalog_dsn, autocommit=True))
        yield s
    finally:
        s.stop()


def set_paused(stack: Stack, dag_id: str, paused: bool) -> None:
    stack.request("PATCH", f"/api/v2/dags/{dag_id}?update_mask=is_paused", {"is_paused": paused})


def runs(stack: Stack, dag_id: str) -> list[dict]:
    return stack.get(f"/api/v2/dags/{dag_id}/dagRuns?limit=100&order_by=run_after")["dag_runs"]


def read(stack: Stack, consumer: str, run_id: str) -> dict:
    """What the consumer's task read from its inlet events."""
    stack.wait_run(consumer, run_id, expect="success")
    entry = stack.get(
        f"/api/v2/dags/{consumer}/dagRuns/{quote(run_id, safe='')}/taskInstances/read/"
        "xcomEntries/return_value?deserialize=true"
    )
    value = entry["value"]
    return json.loads(value) if isinstance(value, str) else value


def consumed(stack: Stack, consumer: str, count: int) -> list[dict]:
    """The consumer's runs once there are at least ``count``, what each read."""
    got = helpers.wait_for(
        lambda: (r := runs(stack, consumer)) and len(r) >= count and r,
        timeout=180,
        poll=1,
        what=f"{count} run(s) of {consumer}",
    )
    return [read(stack, consumer, r["dag_run_id"]) for r in got]


def ended(stack: Stack, dag_id: str, conf: dict) -> tuple[str, str, dict]:
    run_id = stack.trigger(dag_id, conf)
    return run_id, stack.wait_run(dag_id, run_id), stack.task_states(dag_id, run_id)


def test_consumers_run_after_complete_work_only(stack):
    cards = [stack.catalog.card(views=10 * i) for i in range(1, 4)]
    for c in cards:
        stack.catalog.seed_snapshot(c, stack.catalog.today() - timedelta(days=3), 1)
    stack.news.posts(4, drift_every=2)
    for dag_id in (SCORES, COUNTS, CATALOG, NEWS):
        set_paused(stack, dag_id, False)
    try:
        # the scheduled runs of the latest slots: complete nights
        [night] = helpers.wait_for(lambda: runs(stack, CATALOG), timeout=60, what="a night")
        stack.wait_run(CATALOG, night["dag_run_id"], timeout=300, expect="success")
        [first] = consumed(stack, SCORES, 1)
        summary = stack.catalog.one(
            "SELECT result FROM pin_nightly.run_log WHERE run_id = %s", night["dag_run_id"]
        )
        assert first["latest"] == first["triggered_by"][-1]
        assert first["latest"] == {
            "as_of_date": summary["as_of_date"],
            "cards_scored": 3,
            "snapshots_written": 3,
            "resumed": False,
            "run_id": night["dag_run_id"],
        }

        # none of these publishes: each one's publish task is skipped or never runs
        quiet = []
        for conf, state, publish in (
            ({"dry_run": True}, "success", "skipped"),
            ({"card_ids": [cards[0]]}, "success", "skipped"),
            ({"batch_size": 1, "max_run_duration_minutes": 0.0001}, "success", "skipped"),
        ):
            run_id, got, tasks = ended(stack, CATALOG, conf)
            assert (got, tasks["publish"]) == (state, publish), (conf, tasks)
            quiet.append(run_id)
        stack.catalog.q(
            "INSERT INTO pin_nightly.job_lease VALUES ('Pin:lock:job:scheduled:catalog-"
            "popularity-recompute', 'another deployment', 0, '1 hour', now(), "
            "now() + interval '1 hour', now() + interval '1 hour')"
        )
        run_id, got, tasks = ended(stack, CATALOG, {})
        stack.catalog.q("DELETE FROM pin_nightly.job_lease")
        assert (got, tasks["publish"]) == ("success", "skipped")
        quiet.append(run_id)
        stack.catalog.q("ALTER TABLE catalog.project_cards RENAME TO project_cards_away")
        run_id, got, tasks = ended(stack, CATALOG, {})
        stack.catalog.q("ALTER TABLE catalog.project_cards_away RENAME TO project_cards")
        assert got == "failed" and tasks["publish"] in ("upstream_failed", None)
        quiet.append(run_id)

        # the backlog left above is finished by this run, which resumes it and publishes
        complete, got, _ = ended(stack, CATALOG, {})
        assert got == "success"
        after = consumed(stack, SCORES, 2)[1:]
        published = {e["run_id"] for r in after for e in r["triggered_by"]}
        assert complete in published and not published & set(quiet), (published, quiet)
        [event] = [e for r in after for e in r["triggered_by"] if e["run_id"] == complete]
        assert event["resumed"] is True

        # news: the scheduled night, then a dry run (quiet) and a FullSweep that publishes
        [night] = helpers.wait_for(lambda: runs(stack, NEWS), timeout=60, what="a news night")
        stack.wait_run(NEWS, night["dag_run_id"], timeout=300, expect="success")
        dry, got, tasks = ended(stack, NEWS, {"dry_run": True})
        assert (got, tasks["publish"]) == ("success", "skipped")
        stack.news.posts(2, drift_every=1)
        drifted = stack.news.drifted_posts()
        full, got, _ = ended(stack, NEWS, {"scope": "FullSweep"})
        assert got == "success" and stack.news.drifted_posts() == 0

        def events() -> dict[str, dict]:
            return {e["run_id"]: e for r in consumed(stack, COUNTS, 1) for e in r["triggered_by"]}

        helpers.wait_for(lambda: full in events(), timeout=180, poll=2, what="its event")
        published = events()
        assert dry not in published
        assert published[full] == {
            "scope": "FullSweep",
            "posts_reconciled": 6,
            "drift_corrected": drifted,
            "run_id": full,
        }
    finally:
        for dag_id in (CATALOG, NEWS, SCORES, COUNTS):
            set_paused(stack, dag_id, True)
