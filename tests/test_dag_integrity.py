"""The DAG files parse, use only declared pools, and are scheduled as specified."""

from __future__ import annotations

import json

import pytest

from tools.devenv import REPO

POOLS = json.loads((REPO / "pools.json").read_text())
DAGS = {
    "news_comment_reconcile": ("0 3 * * *", "Europe/Moscow"),
    "catalog_popularity_recompute": ("0 3 * * *", "UTC"),
}


@pytest.fixture(scope="module")
def bag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(REPO / "dags"), known_pools=set(POOLS))


def test_dagbag_loads_without_errors_or_warnings(bag):
    assert bag.import_errors == {}
    assert set(DAGS) <= set(bag.dag_ids)
    assert [(w.dag_id, w.message) for w in bag.dag_warnings] == []


def test_unknown_pool_is_reported_by_dagbag():
    """The pool check above is real: without the pools, DagBag warns about each DAG."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags"), known_pools={"default_pool"})
    warned = {w.dag_id: w.message for w in bag.dag_warnings}
    for dag_id in DAGS:
        assert dag_id in warned and dag_id in warned[dag_id]


@pytest.mark.parametrize("dag_id", sorted(DAGS))
def test_schedule_timezone_and_single_flight(bag, dag_id):
    dag = bag.get_dag(dag_id)
    cron, tz = DAGS[dag_id]
    assert dag.timetable.expression == cron
    assert str(getattr(dag.timetable.timezone, "name", dag.timetable.timezone)) == tz
    assert dag.start_date.tzinfo is not None
    assert getattr(dag.timezone, "name", str(dag.timezone)) == tz
    assert dag.catchup is False
    assert dag.max_active_runs == 1
    assert dag.doc_md and "Safe to re-run" in dag.doc_md
    for task in dag.tasks:
        assert task.pool == dag_id, f"{task.task_id} is not in pool {dag_id}"
        assert task.pool in POOLS


def test_dag_files_do_no_work_at_parse_time():
    """Parsing imports no database driver connection and reads no Variable: the DAG files only
    wire tasks (checked by parsing with no connections defined at all)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW_CONN_")}
    code = (
        "from airflow.dag_processing.dagbag import DagBag; "
        f"b = DagBag(dag_folder={str(REPO / 'dags')!r}); "
        "assert not b.import_errors, b.import_errors; print(len(b.dags))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip().splitlines()[-1]) >= len(DAGS)


def test_no_function_of_the_package_is_longer_than_40_lines():
    """The package's functions stay short enough to read at once (docstring included); a longer
    one is split where its steps meet."""
    import ast

    long = []
    for path in sorted((REPO / "plugins").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > 40:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines})")
    assert not long, long


# Each DAG's structure: every task's downstream task ids, and which are the lease's setup and
# teardown. Written out, not derived: a change to the wiring is a change to this table.
STRUCTURE = {
    "news_comment_reconcile": {
        "validate_options": {"acquire_lease", "plan_ranges", "reconcile_range", "summarize"},
        "acquire_lease": {"plan_ranges", "reconcile_range", "release_lease"},
        "plan_ranges": {"reconcile_range", "summarize"},
        "reconcile_range": {"summarize"},
        "summarize": {"release_lease", "publish"},
        "release_lease": set(),
        "publish": set(),
    },
    "catalog_popularity_recompute": {
        "validate_options": {
            "acquire_lease",
            "plan_property_objects",
            "recompute_property_objects",
            "plan_projects",
            "recompute_projects",
            "retention",
            "summarize",
        },
        "acquire_lease": {
            "plan_property_objects",
            "recompute_property_objects",
            "plan_projects",
            "recompute_projects",
            "release_lease",
        },
        "plan_property_objects": {"recompute_property_objects", "retention", "summarize"},
        "recompute_property_objects": {"plan_projects", "retention", "summarize"},
        "plan_projects": {"recompute_projects", "retention", "summarize"},
        "recompute_projects": {"retention", "summarize"},
        "retention": {"summarize"},
        "summarize": {"release_lease", "publish"},
        "release_lease": set(),
        "publish": set(),
    },
}
TRIGGER_RULES = {"retention": "all_done", "summarize": "all_done"}


@pytest.mark.parametrize("dag_id", sorted(STRUCTURE))
def test_each_dag_has_its_structure(bag, dag_id):
    """Every task's downstream ids; acquire_lease the only setup, release_lease the only
    teardown; retention and the summary run once the work is done, whatever became of it."""
    dag = bag.get_dag(dag_id)
    assert {t.task_id: set(t.downstream_task_ids) for t in dag.tasks} == STRUCTURE[dag_id]
    assert [t.task_id for t in dag.tasks if t.is_setup] == ["acquire_lease"]
    assert [t.task_id for t in dag.tasks if t.is_teardown] == ["release_lease"]
    for task in dag.tasks:
        rule = str(getattr(task.trigger_rule, "value", task.trigger_rule))
        expected = "all_done_setup_success" if task.is_teardown else "all_success"
        assert rule == TRIGGER_RULES.get(task.task_id, expected), (task.task_id, rule)
