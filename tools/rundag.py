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


def run_dag(dag_id: str, conf: dict[str, Any] | None = None,
            logical_date: datetime | None = None, run_after: datetime | None = None
            ) -> dict[str, Any]:
    """Run the DAG once; return run id, state, task states and the summary XCom.

    Passing the ``logical_date`` and ``run_after`` of an earlier call runs the same DAG run
    again: its task instances are cleared and run, as when a run is cleared in the UI.
    """
    from airflow.models.dagrun import DagRun
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

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
    with create_session() as session:
        dr = session.query(DagRun).filter(DagRun.dag_id == dag_id,
                                          DagRun.run_id == dr.run_id).one()
        tis = {}
        for ti in dr.get_task_instances(session=session):
            key = ti.task_id if ti.map_index < 0 else f"{ti.task_id}[{ti.map_index}]"
            tis[key] = str(ti.state)
        row = session.scalars(XComModel.get_many(run_id=dr.run_id, dag_ids=dag_id,
                                                 task_ids="summarize", key="return_value")
                              ).first()
        return {"run_id": dr.run_id, "state": str(dr.state), "tasks": tis,
                "summary": XComModel.deserialize_value(row) if row else None}
