"""A job's DAG, written once for every job (:func:`job_dag`): the options' check, the lease's
setup task, one planning task and its mapped range tasks per pass of the job
(:attr:`Job.passes <pin_nightly.jobs.Job.passes>`, in order), the retention task of a job that
has one, the summary, the lease's teardown task and the asset event. A DAG file in ``dags/``
makes its job's DAG with its runbook (``doc_md``)."""

from __future__ import annotations

from typing import Any

import pendulum

from pin_nightly import jobs, runs


def job_dag(job: jobs.Job, doc_md: str) -> Any:
    """The DAG of ``job``: nightly on its schedule (a cron in its timezone), ``doc_md`` its
    runbook in the UI, every task in the job's pool (named as the DAG; its slots are the
    ranges that run at once)."""
    from airflow.sdk import DAG, CronTriggerTimetable

    cron, tz = job.schedule
    with DAG(
        description=job.description,
        schedule=CronTriggerTimetable(cron, timezone=tz),
        start_date=pendulum.datetime(2026, 1, 1, tz=tz),
        doc_md=doc_md,
        tags=["pin-nightly", job.tag],
        # one run at a time, params, deadline alerts (SLA), failed attempts counted, retries
        **jobs.dag_settings(job, job.params, owner=job.owner),
    ) as dag:
        _wire(job, _run_tasks(job, job.dag_id), _work_tasks(job, job.dag_id))
    return dag


def _wire(job: jobs.Job, run_tasks: tuple, work_tasks: tuple) -> None:
    validate_options, acquire_lease, release_lease, publish = run_tasks
    plan, work, retention, summarize = work_tasks
    opts = validate_options()
    lease = acquire_lease(opts)
    done, work_tasks = lease, []
    for kind, plan_id, work_id in job.passes:  # a pass's ranges, then the next pass's planning
        ranges = plan.override(task_id=plan_id)(opts, lease, kind)
        done >> ranges
        done = work.override(task_id=work_id).partial(opts=opts, lease=lease).expand(rng=ranges)
        work_tasks += [ranges, done]
    # directly after every planning and range task: a clear of one of them (all_done looks at
    # the direct upstream tasks only) makes these wait for it again
    summary = summarize(opts)
    work_tasks >> summary
    if job.retention_task:
        pruned = retention(opts)
        work_tasks >> pruned >> summary
    summary >> release_lease(lease)
    publish(summary)


def _run_tasks(job: jobs.Job, pool: str) -> tuple:
    """The tasks around the work: the options, the lease, the asset event. Airflow stores each
    key of a task's ``dict`` result as an XCom of its own too (it infers ``multiple_outputs``):
    the options, the lease and a range's result are one XCom each; the summary keeps its keys,
    which its XCom view lists."""
    from airflow.sdk import setup, task, teardown

    @task(pool=pool, multiple_outputs=False)
    @jobs.config_errors_fail
    def validate_options(params=None, logical_date=None, dag_run=None) -> dict:
        return jobs.validate(job, params, logical_date, dag_run)

    @setup
    @task(pool=pool, multiple_outputs=False)
    @jobs.config_errors_fail
    def acquire_lease(opts: dict, run_id=None) -> dict:
        return jobs.acquire_lease(job, opts, run_id)

    @teardown
    @task(pool=pool)
    def release_lease(lease: dict | None, run_id=None) -> bool:
        return runs.teardown(runs.Run.of(job, {}, run_id, lease))  # needs the lease only

    # An asset event when the run completed its work (skipped, no event, otherwise)
    @task(pool=pool, outlets=[job.asset])
    def publish(summary: dict, outlet_events=None) -> dict:
        return jobs.publish(job.asset, job.asset_extra(summary), outlet_events)

    return validate_options, acquire_lease, release_lease, publish


FAILED_STATES = ["failed", "upstream_failed"]


def _work_tasks(job: jobs.Job, pool: str) -> tuple:
    """The planning and range tasks of a pass, the retention and the summary."""
    from airflow.sdk import get_current_context, task

    # the tasks before the summary, whose failure fails the run
    work_ids = [t for _, plan_id, work_id in job.passes for t in (plan_id, work_id)]
    work_ids += ["retention"] if job.retention_task else []

    @task(pool=pool)
    def plan(opts: dict, lease: dict, kind: str | None, run_id=None) -> list[dict]:
        return runs.plan(runs.Run.of(job, opts, run_id, lease), kind)

    @task(pool=pool, map_index_template="{{ range_label }}", multiple_outputs=False)
    def work(rng: dict, opts: dict, lease: dict, run_id=None) -> dict:
        # the range's own pass (rng["family"]) is worked: tonight's order may differ
        get_current_context()["range_label"] = rng["label"]
        return runs.work_range(runs.Run.of(job, opts, run_id, lease), rng)

    # The lease is pulled here rather than passed: a task right after the setup task must have
    # the trigger rule all_success. These run once the work is done, whatever became of it (a
    # range that failed, one that skipped): retention and the summary run every night, and the
    # summary fails the run when a task of it failed. Neither runs when the lease's setup
    # failed (Airflow marks them upstream_failed).
    @task(pool=pool, trigger_rule="all_done")
    def retention(opts: dict, run_id=None, ti=None) -> int:
        lease = ti.xcom_pull(task_ids="acquire_lease")
        return job.prune(runs.Run.of(job, opts, run_id, lease))

    @task(pool=pool, trigger_rule="all_done")
    def summarize(opts: dict, run_id=None, ti=None) -> dict:
        lease = ti.xcom_pull(task_ids="acquire_lease")
        pruned = ti.xcom_pull(task_ids="retention") if job.retention_task else None
        failed = ti.get_ti_count(
            dag_id=ti.dag_id, task_ids=work_ids, run_ids=[run_id], states=FAILED_STATES
        )
        run = runs.Run.of(job, opts, run_id, lease)
        return runs.summarize(run, failed_tasks=failed, pruned=pruned)

    return plan, work, retention, summarize
