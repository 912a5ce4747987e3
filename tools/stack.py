"""A real Airflow on loopback: scheduler, dag-processor, triggerer and api-server processes
with their metadata on PostgreSQL (used by the end-to-end tests and ``make airflow``); with
:class:`CeleryStack`, on the CeleryExecutor with Celery workers as separate processes and a
throw-away Redis (:class:`Redis`) as the broker."""

from __future__ import annotations

import json
import os
import shutil
import signal
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


def stop_processes(procs: list[subprocess.Popen], timeout: float = 30) -> None:
    """SIGTERM each process, SIGKILL after ``timeout``, then kill the processes they had
    started (the children a parent leaves behind when it dies first)."""
    import psutil

    children: list[psutil.Process] = []
    for p in procs:
        try:
            children += psutil.Process(p.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for c in children:
        try:
            c.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(children, timeout=10)


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
            # no run from the schedule: a test triggers every run it needs, so that what it
            # sees does not depend on the time of day it runs (the latest 03:00 slot may be
            # yesterday's); a stack that needs scheduled runs turns it on
            "AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": "False",
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
        stop_processes(list(self.procs.values()))

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

    def wait_idle(self, dag_ids: list[str], timeout: float = 240) -> None:
        """Until no run of ``dag_ids`` is queued or running: a quiet stack (the stacks create no
        scheduled runs, see stack_env)."""
        deadline = time.monotonic() + timeout
        while True:
            active = [
                r
                for dag_id in dag_ids
                for r in self.get(f"/api/v2/dags/{dag_id}/dagRuns?state=queued&state=running")[
                    "dag_runs"
                ]
            ]
            if not active:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"stack not idle: runs {active}")
            time.sleep(1)

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


# --- CeleryExecutor ------------------------------------------------------------------------


def worker_hostname() -> str:
    """``[core] hostname_callable`` of the workers of :class:`CeleryStack`: the name the worker
    was started with (``PIN_WORKER_HOSTNAME``). Task instances record it as their ``hostname``,
    which tells workers on one machine apart (on separate hosts or containers the default, the
    machine's FQDN, already does)."""
    return os.environ.get("PIN_WORKER_HOSTNAME") or socket.getfqdn()


class Redis:
    """A throw-away ``redis-server`` (Debian's package) on a free loopback port: no RDB
    snapshots, no AOF, its own directory; the Celery broker of :class:`CeleryStack`."""

    def __init__(self, directory: Path, exe: str | None = None):
        self.exe = exe or shutil.which("redis-server")
        self.dir = directory
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 30) -> Redis:
        if not self.exe:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc = subprocess.Popen(
            [
                self.exe,
                "--bind", "127.0.0.1",
                "--port", str(self.port),
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.dir),
                "--logfile", str(self.dir / "redis.log"),
                "--daemonize", "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited; see {self.dir / 'redis.log'}")
            if self.ping():
                return self
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"redis-server did not answer; see {self.dir / 'redis.log'}")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def celery_settings(env: dict[str, str], broker_url: str) -> dict[str, str]:
    """The CeleryExecutor settings of a stack environment: ``broker_url`` as the broker, the
    metadata database (``db+`` its SQLAlchemy URL) as the result backend."""
    return {
        "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
        "AIRFLOW__CELERY__BROKER_URL": broker_url,
        "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"],
    }


class CeleryStack(Stack):
    """A :class:`Stack` on the CeleryExecutor (its environment from :func:`celery_settings`)
    plus Celery workers, each an ``airflow celery worker`` process of its own."""

    def __init__(self, home: Path, env: dict[str, str]):
        super().__init__(home, env)
        self.workers: dict[str, subprocess.Popen] = {}

    def node(self, name: str) -> str:
        """Celery node name of worker ``name`` (also its task instances' hostname)."""
        return f"{name}@{self.home.name}"

    def start_worker(self, name: str, concurrency: int = 2, timeout: float = 90) -> str:
        """Start worker ``name``; return its node name once it consumes tasks."""
        exe = devenv.REPO / ".venv" / "bin" / "airflow"
        node = self.node(name)
        env = {
            **self.env,
            "PIN_WORKER_HOSTNAME": node,
            "AIRFLOW__CORE__HOSTNAME_CALLABLE": "tools.stack.worker_hostname",
        }
        log_path = self.home / f"worker-{name}.log"
        log = open(log_path, "w")  # noqa: SIM115 - closed by the process
        self.workers[name] = subprocess.Popen(
            [
                str(exe), "celery", "worker",
                "--celery-hostname", node,
                "--concurrency", str(concurrency),
                "--pid", str(self.home / f"worker-{name}.pid"),
                # task logs are files under the shared AIRFLOW_HOME, which the api-server reads
                "--skip-serve-logs",
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.workers[name].poll() is not None:
                raise RuntimeError(f"worker {name} exited; see {log_path}")
            if self.ping(node):
                return node
            time.sleep(0.5)
        raise TimeoutError(f"worker {name} not ready; see {log_path}")

    def ping(self, node: str) -> bool:
        """Whether Celery worker ``node`` answers a ping over the broker (it consumes)."""
        from celery import Celery

        app = Celery(broker=self.env["AIRFLOW__CELERY__BROKER_URL"])
        try:
            return any(node in reply for reply in app.control.ping([node], timeout=1.0))
        finally:
            app.close()

    def kill_worker(self, name: str) -> list[int]:
        """SIGKILL worker ``name`` and every process under it (its pool processes, their task
        supervisors and task processes), as a lost host would; return their pids."""
        import psutil

        proc = self.workers.pop(name)
        try:
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        for p in tree:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(tree, timeout=10)
        proc.wait()
        return [p.pid for p in tree]

    def stop_worker(self, name: str, timeout: float = 30) -> None:
        """SIGTERM (Celery's warm shutdown), SIGKILL after ``timeout``, and whatever the worker
        left behind."""
        stop_processes([self.workers.pop(name)], timeout)

    def stop(self) -> None:
        for name in list(self.workers):
            self.stop_worker(name)
        super().stop()
