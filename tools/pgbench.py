"""The platform's hot path as load for the tests and the benchmark, run by pgbench, PostgreSQL's
own load generator, with the custom scripts of ``tools/hot_path/``:

- ``news_comment.sql`` (:data:`NEWS`): the news service's comment create / hide with the
  post's counter +1 / -1 in the same transaction (a post's drift stays as it was);
- ``view_increment.sql`` (:data:`VIEWS`): the catalog consumer's view increment.

A script picks its row by number from ``hot_path_row`` (``n``, ``id``), which :class:`PgBench`
fills in the target database first: the hot rows, picked ``hot_share`` of the time, then the
others (one run at a time per database)::

    with PgBench(dsn, NEWS, ids, hot, clients=6) as load:  # runs until the block ends
        ...
    load.result.committed, load.result.failures

Without ``rate`` every client runs as fast as it can; with it the load is open loop
(``--rate``: transactions start at that rate in total, and a transaction's latency is counted
from its scheduled start, so a stall shows in the transactions queued behind it). The result
comes from pgbench's per-transaction log (``--log``) and its per-command report
(``--report-per-command``). pgbench is ``PIN_PGBENCH``, else the embedded server's (the
``pgserver`` wheel) unless ``PIN_PG_DSN`` names another server, else ``pgbench`` on PATH.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psycopg

NEWS = Path(__file__).resolve().parent / "hot_path" / "news_comment.sql"
VIEWS = NEWS.with_name("view_increment.sql")
NIL = "00000000-0000-0000-0000-000000000000"
# variables a script needs besides the rows': a news client starts with no comment of its own
DEFAULTS = {NEWS: {"hide_pct": 40, "mine": NIL, "mine_post": NIL}, VIEWS: {}}
ACTIVE = "SELECT pid FROM pg_stat_activity WHERE application_name = %s"
REPORT_LINE = re.compile(r"^\s+([\d.]+)\s+\d+\s+(?:\d+\s+)?(\S.*)$")


def _uuid7_now() -> str:
    from pin_nightly.db import sql

    return sql("common/uuid7_now")


def binary() -> str:
    if exe := os.environ.get("PIN_PGBENCH"):
        return exe
    if not os.environ.get("PIN_PG_DSN"):
        import pgserver

        return str(Path(pgserver.__file__).parent / "pginstall" / "bin" / "pgbench")
    if exe := shutil.which("pgbench"):
        return exe
    raise RuntimeError("pgbench not found: put it on PATH or set PIN_PGBENCH")


@dataclass
class Result:
    tx: list[tuple[float, float | None]]  # (start as time.time(), latency ms; None: failed)
    failures: list[str]  # pgbench's error messages, failed transactions, its exit status
    aborted: int  # clients that stopped on an error (the others go on)
    statements: dict[str, float]  # average ms of each command of the script
    elapsed_s: float

    @property
    def committed(self) -> int:
        return sum(ms is not None for _, ms in self.tx)

    def between(self, start: float, end: float) -> list[tuple[float, float | None]]:
        """The transactions that started (open loop: were scheduled) in [start, end]."""
        return [t for t in self.tx if start <= t[0] <= end]


class PgBench:
    """pgbench running ``script`` against ``dsn`` from ``start()`` to ``stop()`` (at most
    ``seconds``); ``settings`` are given to its sessions (``PGOPTIONS``), ``variables`` to the
    script (``--define``); ``pids``: its backends."""

    def __init__(
        self,
        dsn: str,
        script: Path,
        rows: Sequence,
        hot: Sequence = (),
        *,
        hot_share: float = 0.5,
        clients: int = 4,
        rate: float | None = None,
        seconds: int = 600,
        settings: dict | None = None,
        seed: int = 1,
        **variables,
    ):
        if not rows:
            raise ValueError("the hot path needs rows to write to")
        self.dsn, self.script, self.rows, self.hot = dsn, script, list(rows), list(hot)
        self.clients, self.rate, self.seconds = clients, rate, seconds
        self.settings = settings or {}
        hot_pct = round(hot_share * 100) if self.hot else 0
        self.variables = {**DEFAULTS[script], "hot_pct": hot_pct, **variables}
        self.variables |= {"nhot": len(self.hot), "nrest": len(self.rows)}
        self.seed, self.name = seed, f"pgbench {script.stem} {uuid.uuid4().hex[:8]}"
        self.result: Result | None = None

    def start(self, timeout: float = 60) -> PgBench:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(
                "CREATE UNLOGGED TABLE IF NOT EXISTS hot_path_row "
                "(n integer PRIMARY KEY, id uuid NOT NULL)"
            )
            conn.execute("TRUNCATE hot_path_row")
            with conn.cursor().copy("COPY hot_path_row (n, id) FROM STDIN") as copy:
                for row in enumerate([*self.hot, *self.rows], 1):
                    copy.write_row(row)
            conn.execute("ANALYZE hot_path_row")
        self.dir = Path(tempfile.mkdtemp(prefix="pgbench-"))
        script = self.dir / self.script.name  # with {uuid7_now} put in (include/sql/common)
        script.write_text(self.script.read_text().replace("{uuid7_now}", _uuid7_now()))
        cmd = [binary(), "--no-vacuum", "--protocol=prepared", f"--file={script}"]
        cmd += [f"--client={self.clients}", f"--time={self.seconds}", f"--random-seed={self.seed}"]
        cmd += ["--log", f"--log-prefix={self.dir / 'tx'}", "--report-per-command"]
        cmd += ["--verbose-errors", *(f"--define={k}={v}" for k, v in self.variables.items())]
        cmd += [f"--rate={self.rate}"] if self.rate else []
        env = {**os.environ, "PGAPPNAME": self.name}
        if self.settings:
            env["PGOPTIONS"] = " ".join(f"-c {k}={v}" for k, v in self.settings.items())
        out, err = (open(self.dir / n, "w") for n in ("out", "err"))  # noqa: SIM115
        self.started = time.time()  # before its first transaction
        with out, err:
            self.proc = subprocess.Popen([*cmd, self.dsn], stdout=out, stderr=err, env=env)  # noqa: S603
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while True:  # every client connected: pgbench then starts (and handles SIGALRM)
                self.pids = [r[0] for r in conn.execute(ACTIVE, (self.name,))]
                if len(self.pids) == self.clients or self.proc.poll() is not None:
                    break
                if time.time() > self.started + timeout:
                    self.proc.kill()
                    break
                time.sleep(0.02)
        time.sleep(0.1)
        if self.proc.poll() is not None:
            self.stop()
            raise RuntimeError(f"pgbench did not start: {self.result.failures}")
        return self

    def stop(self, timeout: float = 60) -> Result:
        """End the run as ``--time`` does (SIGALRM: each client finishes its transaction, pgbench
        writes its log and report) and read its result."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGALRM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        elapsed = time.time() - self.started
        tx = []
        for path in self.dir.glob("tx.*"):
            for line in path.read_text().splitlines():
                _client, _no, us, _script, sec, usec, *_ = line.split()
                ms = int(us) / 1000 if us.isdigit() else None  # else "failed" or "skipped"
                tx.append((int(sec) + int(usec) / 1e6 - (ms or 0) / 1000, ms))
        failed = sum(ms is None for _, ms in tx)
        failures = [ln for ln in self._read("err").splitlines() if re.search("error|abort", ln)]
        aborted = sum(bool(re.search(r"client \d+ .*aborted", ln)) for ln in failures)
        failures += [f"{failed} transactions failed"] if failed else []
        failures += [f"pgbench exited with {self.proc.returncode}"] if self.proc.returncode else []
        report = map(REPORT_LINE.match, self._read("out").splitlines())
        statements = {m[2]: float(m[1]) for m in report if m and not m[2].startswith("\\")}
        shutil.rmtree(self.dir, ignore_errors=True)
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute("DROP TABLE IF EXISTS hot_path_row")
        self.result = Result(sorted(tx), failures, aborted, statements, elapsed)
        return self.result

    def _read(self, name: str) -> str:
        return (self.dir / name).read_text(errors="replace")

    def __enter__(self) -> PgBench:
        return self.start()

    def __exit__(self, *exc) -> None:
        if self.result is None:
            self.stop()
