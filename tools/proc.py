"""The long-running processes of the harness (the Airflow components, ``airflow standalone``,
Celery workers, Redis): :class:`Proc` starts one in a session of its own, with its environment
and log file, and waits for its readiness check; :func:`stop_tree` stops a process with every
process under it, for the stacks and for ``make stop`` alike."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil


def _tree(roots: Iterable[int], known: dict[int, psutil.Process]) -> dict[int, psutil.Process]:
    """The processes not yet gone among ``roots``, the members of their sessions (a process that
    made a process group of its own, or lost its parent, is still in its session), the processes
    of ``known``, and every process under any of these. A zombie child of this process counts
    as gone (its caller reaps it); any other zombie does not until its parent or init reaps it."""
    table = {p.pid: p for p in psutil.process_iter(["ppid", "status"])}

    def member(pid: int, p: psutil.Process) -> bool:
        try:
            return pid in roots or os.getsid(pid) in roots or known.get(pid) == p
        except OSError:
            return False

    found = {pid for pid, p in table.items() if member(pid, p)}
    while more := {pid for pid, p in table.items() if p.info["ppid"] in found} - found:
        found |= more
    reaped_by_caller = (psutil.STATUS_ZOMBIE, os.getpid())
    return {
        pid: p
        for pid, p in ((pid, table[pid]) for pid in found)
        if (p.info["status"], p.info["ppid"]) != reaped_by_caller
    }


def _send(procs: Iterable[psutil.Process], sig: int) -> None:
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(sig)


def stop_tree(*roots: int, timeout: float = 30, sig: int = signal.SIGTERM) -> list[int]:
    """Send ``sig`` to every process of the trees of ``roots`` (see :func:`_tree`), the roots
    first; wait until they are all gone; SIGKILL whatever is left after ``timeout``, with
    whatever they started meanwhile. Return the pids stopped: those signalled, and those
    killed."""
    roots = tuple(roots)
    seen = _tree(roots, {})
    _send(sorted(seen.values(), key=lambda p: p.pid not in roots), sig)
    stopped = set(seen)
    deadline = time.monotonic() + timeout
    while left := _tree(roots, seen):
        seen.update(left)
        if time.monotonic() > deadline:
            _send(left.values(), signal.SIGKILL)
            stopped |= set(left)
        time.sleep(0.2)
    return sorted(stopped)


def wait_until(
    condition: Callable[[], Any],
    timeout: float = 30,
    procs: Iterable[Proc] = (),
    what: str = "a condition",
    poll: float = 0.5,
) -> Any:
    """Poll until ``condition()`` is truthy and return its value; RuntimeError if one of
    ``procs`` exits first, TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            if p.popen.poll() is not None:
                raise RuntimeError(f"{p.name} exited with code {p.popen.returncode}; see {p.log}")
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


@dataclass
class Proc:
    """A named long-running process: ``argv`` with environment ``env`` (None: this one's), its
    output in file ``log``, ready once ``ready()`` is truthy. It runs in a session of its own,
    so that :meth:`stop` finds everything it started."""

    name: str
    argv: list[Any]
    env: dict[str, str] | None
    log: Path
    ready: Callable[[], Any] = lambda: True
    popen: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def start(self) -> Proc:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as out:
            self.popen = subprocess.Popen(
                [str(a) for a in self.argv],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def wait_ready(self, timeout: float) -> Proc:
        """Return once ready; stop it and raise if it exits first or is not ready in time."""
        try:
            wait_until(self.ready, timeout, [self], f"{self.name}; see {self.log}")
        except BaseException:
            self.stop()
            raise
        return self

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 30, sig: int = signal.SIGTERM) -> list[int]:
        return stop_all([self], timeout, sig)


def stop_all(procs: Iterable[Proc], timeout: float = 30, sig: int = signal.SIGTERM) -> list[int]:
    """:func:`stop_tree` over the started ``procs`` at once; reap them; return the pids
    stopped."""
    procs = [p for p in procs if p.popen is not None]
    pids = stop_tree(*(p.pid for p in procs), timeout=timeout, sig=sig)
    for p in procs:
        p.popen.wait()
    return pids
