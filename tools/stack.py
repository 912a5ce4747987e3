"""A real Airflow on loopback: scheduler, dag-processor, triggerer and api-server processes
(each a :class:`tools.proc.Proc`) with their metadata on PostgreSQL (used by the end-to-end
tests and ``make airflow``); with :class:`CeleryStack`, on the CeleryExecutor with Celery
workers as separate processes and a throw-away Redis (:class:`Redis`) as the broker."""

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
from tools.proc import Proc, stop_all, wait_until

AIRFLOW = devenv.REPO / ".venv" / "bin" / "airflow"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stack_env(
    home: Path, metadata_dsn: str, port: int, extra: dict[str, str] | None = None
) -> dict[str, str]:
    """Environment of every Airflow process of the stack."""
    env = {**os.environ, **devenv.airflow_env(home)}
    env.update(
        {
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": devenv.sqlalchemy_url(metadata_dsn),
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
            # a new or changed DAG file is parsed within 5 s; an unchanged one is parsed again
            # every 10 minutes only (each parse is a process: every 5 s, a fifth of a core)
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "600",
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

    def __init__(self, home: Path, env: dict[str, str], migrated: bool = False):
        """``migrated``: the metadata database is migrated, the pools imported (a copy from
        :func:`tools.devenv.postgres_metadata`), and :meth:`prepare` leaves it as it is."""
        self.home = home
        self.env = env
        self.migrated = migrated
        self.base = f"http://127.0.0.1:{env['AIRFLOW__API__PORT']}"
        self.procs: dict[str, Proc] = {}

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(AIRFLOW), *args], env=self.env, check=True, capture_output=True, text=True
        )

    def start(self, timeout: float = 120) -> Stack:
        self.prepare()
        return self.launch(timeout)

    def prepare(self) -> Stack:
        """Migrate the metadata database and import the pools (slow CLI steps; the first
        writes the home's ``airflow.cfg``), or, when it is ``migrated`` already, write the
        ``airflow.cfg`` only (see :func:`tools.devenv.write_airflow_cfg`)."""
        self.home.mkdir(parents=True, exist_ok=True)
        if self.migrated:
            devenv.write_airflow_cfg(self.env)
        else:
            devenv.prepare_metadata(self.env)
        return self

    def launch(self, timeout: float = 120) -> Stack:
        """Start the components on a prepared metadata database; return once all are healthy."""
        for name in self.COMPONENTS:
            self.procs[name] = Proc(name, [AIRFLOW, name], self.env, self.home / f"{name}.log")
            self.procs[name].start()
        try:
            wait_until(
                self.healthy,
                timeout,
                self.procs.values(),
                f"a healthy Airflow; logs in {self.home}",
            )
            self.warm_execution_api(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def warm_execution_api(self, timeout: float) -> None:
        """Make the api-server's first request to its task execution API here, not in a task.
        That request costs 8 s on an idle 2-core machine and over half a minute on a loaded one,
        and the api-server answers nothing else meanwhile; a task whose start call waits that
        long fails on the workers' ``execution_api_timeout``, before running any code."""
        with urllib.request.urlopen(self.base + "/execution/health", timeout=timeout) as resp:
            resp.read()

    def healthy(self) -> bool:
        """Whether the metadata database and every component report healthy."""
        try:
            health = self.get("/api/v2/monitor/health")
        except OSError:
            return False
        return all(
            health.get(c, {}).get("status") == "healthy"
            for c in ("metadatabase", "scheduler", "triggerer", "dag_processor")
        )

    def stop(self) -> None:
        """Stop the components and every process under them (SIGTERM, SIGKILL after 30 s: a
        scheduler killed in its shutdown leaves its executor workers and log server behind)."""
        stop_all(self.procs.values())
        self.procs.clear()

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
        def parsed() -> bool:
            return set(dag_ids) <= {d["dag_id"] for d in self.get("/api/v2/dags?limit=100")["dags"]}

        what = f"DAGs {dag_ids}; see {self.home}/dag-processor.log"
        wait_until(parsed, timeout, self.procs.values(), what, poll=1)

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
        self,
        dag_id: str,
        run_id: str,
        states=("success", "failed"),
        timeout: float = 300,
        expect: str | None = None,
    ) -> str:
        """The state the run ends in; with ``expect``, an assertion that it is that state
        (failing with the run's :meth:`explain`)."""

        def ended() -> str | None:
            state = self.run_state(dag_id, run_id)
            return state if state in states else None

        state = wait_until(ended, timeout, what=f"{dag_id} {run_id} to end", poll=1)
        if expect is not None and state != expect:
            raise AssertionError(f"run {run_id} ended {state}\n{self.explain(dag_id, run_id)}")
        return state

    def explain(self, dag_id: str, run_id: str) -> str:
        """A failed assertion's evidence: the run's task states and the warnings and errors of
        its task logs (files under the stack's home), in the order they were logged."""
        lines = [f"task states: {self.task_states(dag_id, run_id)}"]
        events = []
        run_dir = self.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}"
        for path in run_dir.rglob("*.log"):
            for line in path.read_text(errors="replace").splitlines():
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if e.get("level") in ("warning", "error", "critical"):
                    where = path.relative_to(run_dir)
                    detail = "".join(map(_error_detail, e.get("error_detail") or []))
                    events.append(
                        f"{e.get('timestamp')} {where} {e['level']}: {e.get('event')} {detail}"
                    )
        return "\n".join(lines + sorted(events))

    def task_states(self, dag_id: str, run_id: str) -> dict[str, str]:
        tis = self.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances?limit=100")
        return {
            (t["task_id"] if t["map_index"] < 0 else f"{t['task_id']}[{t['map_index']}]"): t[
                "state"
            ]
            for t in tis["task_instances"]
        }


def _error_detail(x: Any) -> str:
    """One error of a log event (type, message, innermost frames); whatever a malformed one
    holds, as it is, so that the evidence never hides the assertion it explains."""
    if not isinstance(x, dict):
        return f"\n    {x!r}"
    frames = [f for f in x.get("frames") or [] if isinstance(f, dict)]
    where = " < ".join(f"{f.get('name')}:{f.get('lineno')}" for f in frames[::-1][:4])
    return f"\n    {x.get('exc_type')}: {x.get('exc_value')} at {where}"


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
        self.proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 30) -> Redis:
        if not self.exe:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        self.port = free_port()
        argv = [
            self.exe,
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.dir),
            "--daemonize", "no",
        ]  # fmt: skip
        self.proc = Proc("redis-server", argv, None, self.dir / "redis.log", self.ping).start()
        self.proc.wait_ready(timeout)
        return self

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(timeout=10)


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

    def __init__(self, home: Path, env: dict[str, str], migrated: bool = False):
        super().__init__(home, env, migrated)
        self.workers: dict[str, Proc] = {}

    def node(self, name: str) -> str:
        """Celery node name of worker ``name`` (also its task instances' hostname)."""
        return f"{name}@{self.home.name}"

    def start_worker(self, name: str, concurrency: int = 2, timeout: float = 90) -> str:
        """Start worker ``name``; return its node name once it consumes tasks."""
        node = self.node(name)
        env = {
            **self.env,
            "PIN_WORKER_HOSTNAME": node,
            "AIRFLOW__CORE__HOSTNAME_CALLABLE": "tools.stack.worker_hostname",
        }
        argv = [
            AIRFLOW, "celery", "worker",
            "--celery-hostname", node,
            "--concurrency", str(concurrency),
            "--pid", self.home / f"worker-{name}.pid",
            # task logs are files under the shared AIRFLOW_HOME, which the api-server reads
            "--skip-serve-logs",
        ]  # fmt: skip
        log = self.home / f"worker-{name}.log"
        self.workers[name] = Proc(f"worker {name}", argv, env, log, lambda: self.ping(node))
        self.workers[name].start().wait_ready(timeout)
        return node

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
        return self.workers.pop(name).stop(sig=signal.SIGKILL)

    def stop_worker(self, name: str, timeout: float = 30) -> None:
        """SIGTERM to the worker and every process under it (a task in flight is stopped too),
        SIGKILL after ``timeout``."""
        self.workers.pop(name).stop(timeout)

    def stop(self) -> None:
        stop_all(self.workers.values())
        self.workers.clear()
        super().stop()


class LoginStack(Stack):
    """The stack behind the simple auth manager's login (see :func:`login_stack`): REST calls
    carry the user's token."""

    def __init__(
        self, home: Path, env: dict[str, str], username: str, password: str, migrated: bool = False
    ):
        super().__init__(home, env, migrated)
        self.username, self.password = username, password
        self._token: str | None = None

    def token(self) -> str:
        if self._token is None:
            self._token = self.request(
                "POST", "/auth/token", {"username": self.username, "password": self.password}
            )["access_token"]
        return self._token

    def headers(self, path: str) -> dict[str, str]:
        headers = super().headers(path)
        if not path.startswith(("/api/v2/monitor/", "/auth/token")):
            headers["Authorization"] = f"Bearer {self.token()}"
        return headers

    def fetch(self, path: str, token: bool = True) -> tuple[int, str]:
        """GET ``path`` as the user (``token``) or anonymously: the status and the body."""
        headers = {"Authorization": f"Bearer {self.token()}"} if token else {}
        req = urllib.request.Request(self.base + path, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()


def login_stack(
    home: Path,
    metadata_dsn: str,
    env: dict[str, str],
    username: str = "admin",
    cls=LoginStack,
    migrated: bool = False,
) -> LoginStack:
    """A stack (a ``cls``) whose UI asks for a login: ``username`` (role admin) with a password
    generated for this run, written to the simple auth manager's passwords file before the
    start."""
    import secrets

    password = secrets.token_urlsafe(18)
    passwords_file = home / "simple_auth_manager_passwords.json"
    passwords_file.write_text(json.dumps({username: password}) + "\n")
    login = {
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{username}:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords_file),
    }
    full = stack_env(home, metadata_dsn, free_port(), {**login, **env})
    return cls(home, full, username, password, migrated)
