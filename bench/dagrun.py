"""One whole DAG run through Airflow (``tools.rundag.run_dag``, i.e. ``dag.test()``), in a
process of its own: ``python -m bench.dagrun DAG_ID CONF_JSON LOGICAL_DATE``.

Prints one JSON line: wall time of the run (DAG parse included), its state, the summary XCom,
every task instance's duration (from the metadata database) and the process's peak RSS.
The ``AIRFLOW_CONN_*`` variables come from the caller.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from datetime import datetime

from bench.common import AIRFLOW_HOME, setup_airflow_env


def main() -> None:
    dag_id, conf, logical = (
        sys.argv[1],
        json.loads(sys.argv[2]),
        datetime.fromisoformat(sys.argv[3]),
    )
    setup_airflow_env()
    from tools import devenv

    devenv.init_airflow(AIRFLOW_HOME)
    from tools.rundag import run_dag

    t0 = time.perf_counter()
    r = run_dag(dag_id, conf, logical_date=logical)
    wall = time.perf_counter() - t0

    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session

    tasks = []
    with create_session() as session:
        for ti in session.query(TaskInstance).filter(
            TaskInstance.dag_id == dag_id, TaskInstance.run_id == r["run_id"]
        ):
            tasks.append(
                {
                    "task_id": ti.task_id,
                    "map_index": ti.map_index,
                    "state": str(ti.state),
                    "start": ti.start_date.isoformat() if ti.start_date else None,
                    "end": ti.end_date.isoformat() if ti.end_date else None,
                    "duration": ti.duration,
                }
            )
    tasks.sort(key=lambda t: t["start"] or "")
    print(
        json.dumps(
            {
                "wall_s": wall,
                "run_id": r["run_id"],
                "state": r["state"],
                "summary": r["summary"],
                "task_states": r["tasks"],
                "tasks": tasks,
                "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            },
            default=str,
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
