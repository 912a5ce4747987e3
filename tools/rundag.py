"""Run a DAG of this repository through Airflow (``dag.test()``) and return what it did.

A fresh DagBag parses the DAG file for every run (``dag.test()`` keeps state on the DAG object
between calls).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from tools.devenv import REPO


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
) -> dict[str, Any]:
    """Run the DAG once; return run id, state, task states and the summary XCom.

    Passing the ``logical_date`` and ``run_after`` of an earlier call runs the same DAG run
    again: its task instances are cleared and run, as when a run is cleared in the UI.
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
    dr = dag.test(**kwargs)
    return run_outcome(dag_id, dr.run_id)


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
    with create_session() as session:
        dr = session.query(DagRun).filter(DagRun.dag_id == dag_id, DagRun.run_id == run_id).one()
        dr.dag = scheduler_dag
        while dr.state == DagRunState.RUNNING:
            session.expire_all()
            schedulable, _ = dr.update_state(session=session)
            for ti in schedulable:
                if ti.state != TaskInstanceState.UP_FOR_RESCHEDULE:
                    ti.try_number += 1
                ti.state = TaskInstanceState.SCHEDULED
            session.commit()
            scheduled = [
                ti
                for ti in dr.get_task_instances(session=session)
                if ti.state == TaskInstanceState.SCHEDULED
            ]
            if not scheduled:
                time.sleep(0.2)
            for ti in scheduled:
                try:
                    _run_task(ti=ti, task=dag.task_dict[ti.task_id])
                except Exception:  # noqa: BLE001 - the task's state says it
                    pass
    return run_outcome(dag_id, run_id)


def run_outcome(dag_id: str, run_id: str) -> dict[str, Any]:
    """Run id, state, task states and the summary XCom of a run."""
    from airflow.models.dagrun import DagRun
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        dr = session.query(DagRun).filter(DagRun.dag_id == dag_id, DagRun.run_id == run_id).one()
        tis = {}
        for ti in dr.get_task_instances(session=session):
            key = ti.task_id if ti.map_index < 0 else f"{ti.task_id}[{ti.map_index}]"
            tis[key] = str(ti.state)
        row = session.scalars(
            XComModel.get_many(
                run_id=dr.run_id, dag_ids=dag_id, task_ids="summarize", key="return_value"
            )
        ).first()
        return {
            "run_id": dr.run_id,
            "state": str(dr.state),
            "tasks": tis,
            "summary": XComModel.deserialize_value(row) if row else None,
        }
