"""Run a DAG of this repository through Airflow (``dag.test()``) and return what it did.

A fresh DagBag parses the DAG file for every run (``dag.test()`` keeps state on the DAG object
between calls).

This module is the one place that knows the Airflow internals the tests and the demo use
(:data:`AIRFLOW_INTERNALS`; ``tests/test_units.py`` fails naming the one an upgrade moved).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from tools.devenv import REPO

# Airflow internals (not its public API) used here and by the job package (the job_run span's
# id, the run_over_budget callback's look at its run), as "module:attribute"
AIRFLOW_INTERNALS = (
    "airflow._shared.observability.traces:OverrideableRandomIdGenerator",
    "airflow._shared.observability.traces:override_ids",
    "airflow.sdk.execution_time.task_runner:RuntimeTaskInstance.get_dagrun_state",
    "airflow.dag_processing.dagbag:DagBag",
    "airflow.models.dagrun:DagRun.generate_run_id",
    "airflow.models.dagrun:DagRun.update_state",
    "airflow.models.taskinstance:TaskInstance",
    "airflow.models.xcom:XComModel.get_many",
    "airflow.models.xcom:XComModel.key",
    "airflow.models.xcom:XComModel.deserialize_value",
    "airflow.sdk.definitions.dag:_run_task",
    "airflow.serialization.definitions.dag:SerializedDAG.create_dagrun",
    "airflow.serialization.definitions.dag:SerializedDAG.clear",
    "airflow.serialization.serialized_objects:DagSerialization.serialize_dag",
    "airflow.serialization.serialized_objects:DagSerialization.deserialize_dag",
    "airflow.utils.session:create_session",
    "airflow.utils.state:DagRunState",
    "airflow.utils.state:TaskInstanceState",
    "airflow.utils.types:DagRunType.from_run_id",
)


def load_dag(dag_id: str):
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags" / f"{dag_id}.py"))
    if bag.import_errors:
        raise RuntimeError(f"import errors: {bag.import_errors}")
    return bag.dags[dag_id]


def run_dag(
    dag_id: str,
    conf: dict[str, Any] | None = None,
    logical_date: datetime | None = None,
    run_after: datetime | None = None,
    run_id: str | None = None,
) -> dict[str, Any]:
    """Run the DAG once; return run id, state, task states and the summary XCom.

    Passing the ``logical_date`` and ``run_after`` of an earlier call runs the same DAG run
    again: its task instances are cleared and run, as when a run is cleared in the UI.
    ``run_id`` names the run (``dag.test()`` names it ``manual__<now>``), e.g. the
    ``scheduled__<slot>`` that every deployment firing a slot gives its run.
    """

    dag = load_dag(dag_id)
    # apache/airflow#73428: dag.test() crashes when it marks a run of a DAG with deadline=
    # successful (it looks deadline alerts up by the in-memory definitions instead of their
    # ids). The run here goes without the alerts; the DAG file, the DAG serialized to the
    # metadata database and every scheduled run keep them (tests/test_operations.py runs them
    # through a real scheduler and triggerer).
    dag.deadline = None
    kwargs: dict[str, Any] = {"run_conf": conf or {}}
    if logical_date is not None:
        kwargs["logical_date"] = logical_date
    if run_after is not None:
        kwargs["run_after"] = run_after
    with _named(run_id), _in_scheduler_order(), schemas_checked_once():
        dr = dag.test(**kwargs)
    return run_outcome(dag_id, dr.run_id)


_CHECKED_SCHEMAS: set[str] = set()


@contextmanager
def schemas_checked_once() -> Iterator[None]:
    """Airflow checks a param's value with ``jsonschema.validate``, which first checks the
    schema itself against its meta-schema: a run of a DAG with 20 params does that about 1,600
    times, a third of the time ``dag.test()`` takes. Here each schema is checked once per
    process (the first time a value is validated against it), then values are validated
    against it as before; every value is still checked, and a bad schema still fails."""
    import json
    from unittest import mock

    import jsonschema
    from jsonschema.exceptions import best_match
    from jsonschema.validators import validator_for

    real = jsonschema.validate

    def validate(instance, schema, cls=None, *args, **kwargs):
        key = json.dumps(schema, sort_keys=True, default=str)
        if key not in _CHECKED_SCHEMAS:
            real(instance, schema, cls, *args, **kwargs)  # checks the schema, then the value
            _CHECKED_SCHEMAS.add(key)
            return
        validator = (cls or validator_for(schema))(schema, *args, **kwargs)
        error = best_match(validator.iter_errors(instance))
        if error is not None:
            raise error

    with mock.patch.object(jsonschema, "validate", validate):
        yield


@contextmanager
def _in_scheduler_order() -> Iterator[None]:
    """``dag.test()`` runs the task instances it scheduled in the order of a set; the scheduler
    queues them by priority weight, logical date and map index (the ORDER BY of its query), and
    a sweep's ranges are queued in that order on purpose (what a cut night left goes first).
    Task instances hashed by their map index make the set iterate in that order (small ints hash
    to themselves), so a run here takes its ranges in the order a deployment does."""
    from unittest import mock

    from airflow.models.taskinstance import TaskInstance

    with mock.patch.object(TaskInstance, "__hash__", lambda ti: ti.map_index + 2):
        yield


@contextmanager
def _named(run_id: str | None) -> Iterator[None]:
    """``dag.test()`` names its run ``run_id`` (and gives it the type the id says, e.g.
    scheduled: Airflow refuses a manual run named like a scheduled one)."""
    if run_id is None:
        yield
        return
    from unittest import mock

    from airflow.models.dagrun import DagRun
    from airflow.serialization.definitions.dag import SerializedDAG
    from airflow.utils.types import DagRunType

    create = SerializedDAG.create_dagrun

    def create_typed(self, *args, **kwargs):
        return create(self, *args, **{**kwargs, "run_type": DagRunType.from_run_id(run_id)})

    with (
        mock.patch.object(DagRun, "generate_run_id", return_value=run_id),
        mock.patch.object(SerializedDAG, "create_dagrun", create_typed),
    ):
        yield


def clear_and_resume(
    dag_id: str, run_id: str, task_ids: list | None = None, only_failed: bool = True
) -> dict[str, Any]:
    """Clear task instances of an existing run and run what is then runnable, as the scheduler
    would after a data team clears tasks in the UI (``dag.test()`` can only re-create a whole
    run). ``task_ids`` (ids or ``(id, map_index)``) limits the clear, as clearing one task
    instance does; Airflow adds its setup and teardown tasks. ``only_failed`` is the UI's
    "only failed" (failed and upstream-failed tasks; succeeded setups are kept, with their
    XComs)."""
    import time

    from airflow.models.dagrun import DagRun
    from airflow.sdk.definitions.dag import _run_task
    from airflow.serialization.serialized_objects import DagSerialization
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState, TaskInstanceState

    dag = load_dag(dag_id)
    dag.deadline = None  # apache/airflow#73428, as in run_dag
    scheduler_dag = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag))
    with create_session() as session:
        scheduler_dag.clear(
            task_ids=task_ids,
            run_id=run_id,
            only_failed=only_failed,
            dag_run_state=DagRunState.RUNNING,
            session=session,
        )
    with create_session() as session, schemas_checked_once():
        dr = session.query(DagRun).filter(DagRun.dag_id == dag_id, DagRun.run_id == run_id).one()
        dr.dag = scheduler_dag
        idle_since = time.monotonic()
        while dr.state == DagRunState.RUNNING:
            session.expire_all()
            schedulable, _ = dr.update_state(session=session)
            for ti in schedulable:
                if ti.state != TaskInstanceState.UP_FOR_RESCHEDULE:
                    ti.try_number += 1
                ti.state = TaskInstanceState.SCHEDULED
            session.commit()
            scheduled = sorted(
                (
                    ti
                    for ti in dr.get_task_instances(session=session)
                    if ti.state == TaskInstanceState.SCHEDULED
                ),
                key=lambda ti: (-(ti.priority_weight or 0), ti.map_index),  # the scheduler's order
            )
            if scheduled:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > 60:
                states = {
                    (ti.task_id, ti.map_index): str(ti.state)
                    for ti in dr.get_task_instances(session=session)
                }
                raise RuntimeError(f"run {run_id} is running with nothing to run: {states}")
            else:
                time.sleep(0.2)
            for ti in scheduled:
                try:
                    _run_task(ti=ti, task=dag.task_dict[ti.task_id])
                except Exception:  # noqa: BLE001 - the task's state says it
                    pass
    return run_outcome(dag_id, run_id)


def run_outcome(dag_id: str, run_id: str) -> dict[str, Any]:
    """Run id, logical date, run-after instant, state, task states, the summary XCom and the
    note of a run."""
    from airflow.models.dagrun import DagRun
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        dr = session.query(DagRun).filter(DagRun.dag_id == dag_id, DagRun.run_id == run_id).one()
        tis = {}
        for ti in dr.get_task_instances(session=session):
            tis[_ti_name(ti.task_id, ti.map_index)] = str(ti.state)
        row = session.scalars(
            XComModel.get_many(
                run_id=dr.run_id, dag_ids=dag_id, task_ids="summarize", key="return_value"
            )
        ).first()
        return {
            "run_id": dr.run_id,
            "logical_date": dr.logical_date,
            "run_after": dr.run_after,
            "state": str(dr.state),
            "tasks": tis,
            "summary": XComModel.deserialize_value(row) if row else None,
            "note": dr.note,
        }


def xcom_keys(dag_id: str, run_id: str) -> dict[str, set[str]]:
    """The XCom keys each task instance of a run stored (``task`` or ``task[map_index]``)."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    out: dict[str, set[str]] = {}
    with create_session() as session:
        rows = session.query(XComModel.task_id, XComModel.map_index, XComModel.key).filter(
            XComModel.dag_id == dag_id, XComModel.run_id == run_id
        )
        for task_id, map_index, key in rows:
            out.setdefault(_ti_name(task_id, map_index), set()).add(key)
    return out


def _ti_name(task_id: str, map_index: int) -> str:
    """A task instance as the UI names it: ``task``, or ``task[map_index]`` when mapped."""
    return task_id if map_index < 0 else f"{task_id}[{map_index}]"


def run_count(dag_id: str) -> int:
    """How many runs of the DAG the metadata database holds."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session

    with create_session() as session:
        return session.query(DagRun).filter(DagRun.dag_id == dag_id).count()


def return_values(dag_id: str, run_id: str, task_id: str) -> list[Any]:
    """The return values of a task of a run (one per mapped task instance)."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        rows = session.scalars(
            XComModel.get_many(run_id=run_id, dag_ids=dag_id, task_ids=task_id, key="return_value")
        ).all()
        return [XComModel.deserialize_value(r) for r in rows]


def main(argv: list[str] | None = None) -> None:
    """``python -m tools.rundag DAG_ID [--home DIR] [--conf JSON] [--run-id ID]
    [--logical-date ISO]``: one run in an Airflow of its own (the metadata database under
    ``--home``, migrated on first use), e.g. a second deployment next to the test's own
    Airflow; prints the outcome as JSON on the last line."""
    import argparse
    import json

    from tools import devenv

    ap = argparse.ArgumentParser(prog="python -m tools.rundag")
    ap.add_argument("dag_id")
    ap.add_argument("--home", type=Path, default=REPO / ".airflow")
    ap.add_argument("--conf", type=json.loads, default={})
    ap.add_argument("--run-id")
    ap.add_argument("--logical-date", type=datetime.fromisoformat)
    args = ap.parse_args(argv)
    devenv.init_airflow(args.home)
    out = run_dag(args.dag_id, args.conf, logical_date=args.logical_date, run_id=args.run_id)
    print(json.dumps(out, default=str), flush=True)


if __name__ == "__main__":
    main()
