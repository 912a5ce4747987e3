"""A real Airflow on loopback: scheduler, dag-processor, triggerer and api-server processes
with their metadata on PostgreSQL (used by the end-to-end tests and ``make airflow``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tools import devenv


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stack_env(
    home: Path, metadata_dsn: str, port: int, extra: dict[str, str] | None = None
) -> dict[str, str]:
    """Environment of every Airflow process of the stack."""
    from psycopg.conninfo import conninfo_to_dict

    d = conninfo_to_dict(metadata_dsn)
    auth = d.get("user", "postgres") + (f":{d['password']}" if d.get("password") else "")
    hostpart = (
        f"{d['host']}:{d.get('port', 5432)}" if not str(d.get("host", "")).startswith("/") else ""
    )
    query = f"?host={d['host']}" if not hostpart else ""
    env = {**os.environ, **devenv.airflow_env(home)}
    env.update(
        {
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"postgresql+psycopg2://{auth}@{hostpart}/{d['dbname']}{query}",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(port),
            # the UI's address: alert messages link to runs under it
            "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "5",
            "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "1",
            "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
            "PYTHONWARNINGS": "ignore",
        }
    )
    env.update(extra or {})
    return env


class Stack:
    """Start the four Airflow processes; talk to the REST API."""

    COMPONENTS = ("scheduler", "dag-processor", "triggerer", "api-server")

    def __init__(self, home: Path, env: dict[str, str]):
        self.home = home
        self.env = env
        self.base = f"http://127.0.0.1:{env['AIRFLOW__API__PORT']}"
        self.procs: dict[str, subprocess.Popen] = {}

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        exe = devenv.REPO / ".venv" / "bin" / "airflow"
        return subprocess.run(
            [str(exe), *args], env=self.env, check=True, capture_output=True, text=True
        )

    def start(self, timeout: float = 120) -> Stack:
        self.prepare()
        return self.launch(timeout)

    def prepare(self) -> Stack:
        """Migrate the metadata database and import the pools (slow CLI steps)."""
        self.home.mkdir(parents=True, exist_ok=True)
        self.cli("db", "migrate")
        self.cli("pools", "import", str(devenv.REPO / "pools.json"))
        return self

    def launch(self, timeout: float = 120) -> Stack:
        """Start the components on a prepared metadata database; return once all are healthy."""
        exe = devenv.REPO / ".venv" / "bin" / "airflow"
        for name in self.COMPONENTS:
            log = open(self.home / f"{name}.log", "w")  # noqa: SIM115 - closed by the process
            self.procs[name] = subprocess.Popen(
                [str(exe), name], env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                health = self.get("/api/v2/monitor/health")
                if all(
                    health.get(c, {}).get("status") == "healthy"
                    for c in ("metadatabase", "scheduler", "triggerer", "dag_processor")
                ):
                    return self
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"Airflow did not become healthy; logs in {self.home}")

    def stop(self) -> None:
        """Terminate the components (SIGKILL after 30 s), then the processes they started and
        left behind (a scheduler killed in its shutdown leaves its executor workers and log
        server running)."""
        import psutil

        children: list[psutil.Process] = []
        for p in self.procs.values():
            try:
                children += psutil.Process(p.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        for p in self.procs.values():
            p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for c in children:
            try:
                c.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(children, timeout=10)

    def headers(self, path: str) -> dict[str, str]:  # noqa: ARG002 - a subclass may need it
        """Headers of a REST call to ``path`` (a stack behind a login adds its token)."""
        return {"Content-Type": "application/json"}

    def request(self, method: str, path: str, body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.base + path, data=data, method=method, headers=self.headers(path)
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                text = resp.read()
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{method} {path}: HTTP {exc.code}: {exc.read()[:2000]!r}") from None
        return json.loads(text) if text else None

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def wait_for_dags(self, dag_ids: list[str], timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            known = {d["dag_id"] for d in self.get("/api/v2/dags?limit=100")["dags"]}
            if set(dag_ids) <= known:
                return
            time.sleep(1)
        raise TimeoutError(f"DAGs {dag_ids} not parsed; see {self.home}/dag-processor.log")

    def trigger(self, dag_id: str, conf: dict | None = None) -> str:
        run = self.request(
            "POST", f"/api/v2/dags/{dag_id}/dagRuns", {"logical_date": None, "conf": conf or {}}
        )
        return run["dag_run_id"]

    def run_state(self, dag_id: str, run_id: str) -> str:
        return self.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}")["state"]

    def wait_run(
        self, dag_id: str, run_id: str, states=("success", "failed"), timeout: float = 180
    ) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.run_state(dag_id, run_id)
            if state in states:
                return state
            time.sleep(1)
        raise TimeoutError(f"{dag_id} {run_id} still {state}")

    def task_states(self, dag_id: str, run_id: str) -> dict[str, str]:
        tis = self.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances?limit=100")
        return {
            (t["task_id"] if t["map_index"] < 0 else f"{t['task_id']}[{t['map_index']}]"): t[
                "state"
            ]
            for t in tis["task_instances"]
        }
