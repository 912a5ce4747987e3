"""`make airflow` and `make stop` as a new user meets them: from a plain shell (no virtualenv on
PATH), the UI answers, both DAGs are there, a run triggered over REST succeeds, and `make stop`
leaves no process behind and the port free."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tools.devenv import REPO
from tools.stack import free_port

pytestmark = pytest.mark.stack  # real Airflow components: make test-all

PIDFILE = REPO / ".airflow" / "standalone.pid"
PLAIN_PATH = os.pathsep.join(p for p in ("/usr/local/bin", "/usr/bin", "/bin") if Path(p).is_dir())


def _api(port: int, method: str, path: str, body=None, token: str | None = None):
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        method=method,
        data=json.dumps(body).encode() if body is not None else None,
        headers=headers,
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read() or b"null")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _group_alive(pgid: int) -> list[str]:
    out = subprocess.run(
        ["ps", "-o", "pid=,stat=,args=", "-g", str(pgid)], capture_output=True, text=True
    ).stdout
    return [ln for ln in out.splitlines() if ln.split()[1:2] and not ln.split()[1].startswith("Z")]


def test_make_airflow_from_a_plain_shell_then_make_stop(pg_admin):
    if PIDFILE.exists():
        pytest.skip(f"a `make airflow` of this checkout is running ({PIDFILE}); stop it first")
    if shutil.which("make", path=PLAIN_PATH) is None:
        pytest.skip("make is not on the plain PATH")
    port = free_port()
    env = {
        "HOME": os.environ.get("HOME", "/root"),
        "PATH": PLAIN_PATH,
        "PIN_AIRFLOW_PORT": str(port),
        "PIN_PG_DSN": pg_admin,
    }
    assert str(REPO / ".venv") not in env["PATH"]
    log = open(REPO / ".airflow" / "make-airflow-test.log", "w")
    proc = subprocess.Popen(
        ["make", "airflow"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True
    )
    pgid = None
    try:
        deadline = time.monotonic() + 300
        text = ""
        while time.monotonic() < deadline and proc.poll() is None:
            text = (REPO / ".airflow" / "make-airflow-test.log").read_text()
            if "Airflow is ready" in text:
                break
            time.sleep(1)
        assert "Airflow is ready" in text, text[-3000:]
        assert f"http://127.0.0.1:{port}" in text
        pgid = int(PIDFILE.read_text().split()[1])
        password = json.loads(
            (
                REPO / ".airflow" / "standalone" / "simple_auth_manager_passwords.json.generated"
            ).read_text()
        )["admin"]
        assert f"admin / {password}" in text
        token = _api(port, "POST", "/auth/token", {"username": "admin", "password": password})[
            "access_token"
        ]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            dags = {d["dag_id"] for d in _api(port, "GET", "/api/v2/dags", token=token)["dags"]}
            if {"news_comment_reconcile", "catalog_popularity_recompute"} <= dags:
                break
            time.sleep(2)
        assert {"news_comment_reconcile", "catalog_popularity_recompute"} <= dags
        dag = "news_comment_reconcile"
        _api(
            port, "PATCH", f"/api/v2/dags/{dag}?update_mask=is_paused", {"is_paused": False}, token
        )
        run = _api(
            port,
            "POST",
            f"/api/v2/dags/{dag}/dagRuns",
            {"logical_date": None, "conf": {"scope": "FullSweep"}},
            token,
        )
        deadline = time.monotonic() + 180
        state = None
        while time.monotonic() < deadline and state not in ("success", "failed"):
            time.sleep(2)
            state = _api(
                port, "GET", f"/api/v2/dags/{dag}/dagRuns/{run['dag_run_id']}", token=token
            )["state"]
        assert state == "success"
        assert _group_alive(pgid)
    finally:
        stopped = subprocess.run(
            ["make", "stop"], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
        )
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    assert stopped.returncode == 0, stopped.stderr
    assert "stopped Airflow" in stopped.stdout, stopped.stdout
    assert proc.returncode == 0
    assert _group_alive(pgid) == []
    assert _port_free(port)
    assert not PIDFILE.exists()
