"""A PostgreSQL primary with a streaming hot standby, from the ``pgserver`` wheel's binaries, for
the tests of pacing on the database's health.

The pair is a cluster of its own (``initdb`` into a temporary directory, then ``pg_basebackup
-R -X stream`` into a second one), not a standby of the shared embedded server: a standby whose
replay a test pauses makes every job on its primary see replication lag, and the shared server
also serves other test sessions; its own primary also runs with ``archive_mode = on``, whose
archiver a test can stop and start (``archive_stop`` / ``archive_go``). Each server listens on
a unix socket in its own data directory only; as root, both run as the ``pgserver`` user that
the wheel uses for the embedded server.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from tools.proc import Proc

BIN = Path(__import__("pgserver").__file__).parent / "pginstall" / "bin"
OS_USER = "pgserver"  # the wheel's system user for servers started by root


def _as_server_user() -> list[str]:
    """The argv prefix that runs a server binary as a user PostgreSQL accepts (not root)."""
    if os.geteuid() != 0:
        return []
    return ["setpriv", f"--reuid={OS_USER}", f"--regid={OS_USER}", "--init-groups", "--"]


def _chown(path: Path) -> None:
    if os.geteuid() == 0:
        pw = pwd.getpwnam(OS_USER)
        os.chown(path, pw.pw_uid, pw.pw_gid)


def _run(*argv: str) -> None:
    out = subprocess.run(
        [*_as_server_user(), *argv], capture_output=True, text=True, timeout=120, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {out.stdout}{out.stderr}")


@dataclass
class Server:
    """One postgres process on the unix socket in its data directory ``datadir``."""

    name: str
    datadir: Path
    port: int
    proc: Proc | None = None

    def dsn(self, dbname: str = "postgres") -> str:
        return f"host={self.datadir} port={self.port} user=postgres dbname={dbname}"

    def start(self, timeout: float = 60) -> Server:
        def ready() -> bool:
            try:
                with psycopg.connect(self.dsn(), connect_timeout=2) as c:
                    c.execute("SELECT 1")
                return True
            except psycopg.Error:
                return False

        self.proc = Proc(
            self.name,
            [*_as_server_user(), BIN / "postgres", "-D", self.datadir],
            None,
            self.datadir.parent / f"{self.name}.log",
            ready,
        )
        self.proc.start().wait_ready(timeout)
        return self

    def stop(self) -> None:
        """Immediate shutdown (SIGQUIT): a throwaway server, deleted right after."""
        if self.proc is not None and self.proc.popen is not None:
            self.proc.stop(timeout=15, sig=signal.SIGQUIT)
        self.proc = None

    def sql(self, statement: str, *params, dbname: str = "postgres"):
        with psycopg.connect(self.dsn(dbname), autocommit=True) as c:
            cur = c.execute(statement, params or None)
            return cur.fetchall() if cur.description else []


def _conf(datadir: Path, port: int, extra: dict[str, str]) -> None:
    settings = {
        "listen_addresses": "''",
        "unix_socket_directories": f"'{datadir}'",
        "port": str(port),
        "fsync": "off",  # a throwaway cluster: no flush waits on this shared test machine
        "full_page_writes": "on",
        "shared_buffers": "32MB",
        "max_connections": "40",
        "logging_collector": "off",
        **extra,
    }
    with open(datadir / "postgresql.auto.conf", "a", encoding="utf-8") as f:
        f.writelines(f"{k} = {v}\n" for k, v in settings.items())


@dataclass
class Pair:
    """A primary and its streaming hot standby in ``root`` (deleted by :meth:`stop`)."""

    root: Path
    primary: Server
    standby: Server
    archive: Path = field(init=False)

    def __post_init__(self) -> None:
        self.archive = self.root / "archive"

    @property
    def archive_stop_file(self) -> Path:
        return self.root / "archive.stop"

    def archive_stop(self) -> None:
        """Make every archive_command fail from now on: ready segments pile up."""
        self.archive_stop_file.touch()

    def archive_go(self) -> None:
        self.archive_stop_file.unlink(missing_ok=True)

    def pause_replay(self) -> None:
        self.standby.sql("SELECT pg_wal_replay_pause()")

    def resume_replay(self) -> None:
        self.standby.sql("SELECT pg_wal_replay_resume()")

    def replay_lag(self) -> tuple[float | None, int | None]:
        """The standby's replay lag seen by the primary: (seconds, bytes)."""
        rows = self.primary.sql(
            "SELECT extract(epoch FROM replay_lag)::float8, "
            "pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn)::bigint FROM pg_stat_replication"
        )
        return rows[0] if rows else (None, None)

    def wait_caught_up(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.replay_lag()[1] == 0:
                return
            time.sleep(0.05)
        raise TimeoutError(f"standby not caught up after {timeout} s: {self.replay_lag()}")

    def stop(self) -> None:
        for server in (self.standby, self.primary):
            try:
                server.stop()
            except Exception:  # noqa: BLE001, S110 - the directory goes anyway
                pass
        shutil.rmtree(self.root, ignore_errors=True)


def start_pair(suffix: str = "", port: int = 5433) -> Pair:
    """Start a fresh primary (``port``) and its hot standby (``port + 1``), each on the unix
    socket in its own data directory under a new temporary directory named after ``suffix``."""
    root = Path(tempfile.mkdtemp(prefix=f"pin-replica{suffix}-"))
    _chown(root)
    primary = Server("primary", root / "primary", port)
    standby = Server("standby", root / "standby", port + 1)
    pair = Pair(root, primary, standby)
    try:
        pair.archive.mkdir()
        _chown(pair.archive)
        _run(
            str(BIN / "initdb"),
            "-D",
            str(primary.datadir),
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
            "-E",
            "UTF8",
            "--locale=C",
        )
        stop, dest = pair.archive_stop_file, pair.archive
        _conf(
            primary.datadir,
            port,
            {
                "wal_level": "replica",
                "max_wal_senders": "4",
                "archive_mode": "on",
                "archive_command": f"'test ! -e {stop} && cp %p {dest}/%f'",
            },
        )
        primary.start()
        _run(
            str(BIN / "pg_basebackup"),
            "-d",
            primary.dsn(),
            "-D",
            str(standby.datadir),
            "-R",
            "-X",
            "stream",
            "-c",
            "fast",
            "--no-sync",
        )
        # the copied configuration is the primary's; these lines come after it and win
        _conf(standby.datadir, port + 1, {"hot_standby": "on", "archive_mode": "off"})
        standby.start()
        pair.wait_caught_up()
    except BaseException:
        pair.stop()
        raise
    return pair
