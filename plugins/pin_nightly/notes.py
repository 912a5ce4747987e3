"""The note of a job's DAG run: its outcome in one line, which the grid shows beside the run.

Every ending of a run is green or red in the grid, and ``success``, ``backlog_remaining``,
``nothing written: ...`` and ``skipped, lock held`` are all green: the note says which. An
Airflow listener (registered by ``plugins/pin_nightly_plugin.py``) sets it in the scheduler when
a run of one of the jobs' DAGs ends, from the summary task's result; a note a person wrote is
kept.
"""

from __future__ import annotations

import logging
from typing import Any

from airflow.listeners import hookimpl

log = logging.getLogger(__name__)

DAG_IDS = ("news_comment_reconcile", "catalog_popularity_recompute")


@hookimpl
def on_dag_run_success(dag_run, msg: str) -> None:  # noqa: ARG001
    _set_note(dag_run)


@hookimpl
def on_dag_run_failed(dag_run, msg: str) -> None:  # noqa: ARG001
    _set_note(dag_run)


def outcome(headline: str, result: dict[str, Any] | None, failed: list[str]) -> str:
    """The note of a run: its summary's status and ``headline`` (a format of the result), or,
    when the summary returned nothing, the tasks that failed."""
    if result is None:
        tasks = ", ".join(failed) or "none"
        return f"failed before its summary (failed tasks: {tasks}): see the runbook"
    status = result["status"]
    if status.startswith("skipped"):
        return f"{status}: another run of the job held its lease; nothing was done"
    line = f"{status}: {headline % result}" if headline else status
    if result.get("dry_run"):
        line += " (dry run: nothing written)"
    if result.get("unfinished_sweeps"):
        line += "; left for the next run: " + ", ".join(result["unfinished_sweeps"])
    return line


def _set_note(dag_run) -> None:
    if dag_run.dag_id not in DAG_IDS:
        return
    try:
        from sqlalchemy.orm import object_session

        session = object_session(dag_run)
        if session is not None:  # the scheduler's: written with its state change
            _write(session, dag_run)
            return
        from airflow.models.dagrun import DagRun
        from airflow.utils.session import create_session

        with create_session() as session:  # a run handed over detached (dag.test())
            run = session.get(DagRun, dag_run.id)
            if run is not None:
                _write(session, run)
    except Exception:  # noqa: BLE001 - a note must never fail the scheduler's loop
        log.exception("could not set the note of %s", dag_run)


def _write(session, dag_run) -> None:
    note = dag_run.dag_run_note
    if note is not None and note.user_id is not None:
        return  # a person's note stays
    dag_run.note = outcome(_headline(dag_run.dag_id), *_summary(session, dag_run))


def _headline(dag_id: str) -> str:
    from pin_nightly.jobs import registered

    return {j.dag_id: j.headline for j in registered()}[dag_id]


def _summary(session, dag_run) -> tuple[dict[str, Any] | None, list[str]]:
    """The summary task's result (None when it returned none) and the failed tasks' ids."""
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from airflow.utils.state import TaskInstanceState
    from sqlalchemy import select

    row = session.scalars(
        XComModel.get_many(
            run_id=dag_run.run_id, dag_ids=dag_run.dag_id, task_ids="summarize", key="return_value"
        )
    ).first()
    failed = session.scalars(
        select(TaskInstance.task_id)
        .where(
            TaskInstance.dag_id == dag_run.dag_id,
            TaskInstance.run_id == dag_run.run_id,
            TaskInstance.state.in_([TaskInstanceState.FAILED, TaskInstanceState.UPSTREAM_FAILED]),
        )
        .distinct()
    ).all()
    return (XComModel.deserialize_value(row) if row else None), sorted(failed)
