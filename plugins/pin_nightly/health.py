"""Pacing on the database's health: before each batch, outside any transaction, a range reads
the health signals (one row of :data:`LIMITS` each, read by ``include/sql/health/signals.sql``
or measured by the range) and pauses while one is over its limit, backing off from
:data:`FIRST_PAUSE_S` to :data:`MAX_PAUSE_S`, never past the range's share of the run's budget.
Signals, params, logs and metrics: docs/operations.md, "Pacing on the database's health".
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pin_nightly import metrics
from pin_nightly.db import connect, fetch_one_dict, first_line, from_database, sql, transaction

log = logging.getLogger(__name__)

FIRST_PAUSE_S = 0.5  # the first recheck; most vacuums of a small table are over by then
MAX_PAUSE_S = 4.0  # the longest wait between two rechecks: a pause outlasts its cause by less
WAL_WINDOW_S = 10.0  # the WAL rate is measured over about this many of the last seconds
MIN_WAL_SPAN_S = 1.0  # ... and over at least this many (one fast batch is no rate)
MB = 1024 * 1024
METRIC = "pin_nightly_pauses_total"

# the replicas a run names (Airflow connection ids); none: every replica the primary streams to
REPLICAS_PARAM = "pace_replica_conn_ids"


@dataclass(frozen=True)
class Limit:
    """One pacing signal: its param (the limit; 0 or False turns it off), default and what
    it pauses on (the param's description), and the column of ``health/signals`` that reads
    it (None: measured by the range itself, see :meth:`Health.read`)."""

    param: str
    signal: str
    default: float | bool
    pauses_while: str
    column: str | None = None
    integer: bool = False


# The pacing signals: a new one is a row here and a column of include/sql/health/signals.sql.
LIMITS = (
    Limit(
        "pace_max_replica_lag_seconds",
        "replica_lag_seconds",
        30,
        "a streaming replica's replay lag (pg_stat_replication) is over this many seconds",
    ),
    Limit(
        "pace_max_replica_lag_mb",
        "replica_lag_mb",
        1024,
        "a streaming replica has more than this many MB of WAL not replayed yet",
    ),
    Limit(
        "pace_on_vacuum",
        "vacuum",
        True,
        "a VACUUM (autovacuum or manual) runs on a table they write",
    ),
    Limit(
        "pace_max_wal_mb_per_second",
        "wal_mb_per_second",
        32,
        "the server writes more than this many MB of WAL per second (over the last ~10 s of "
        "the range's work)",
    ),
    Limit(
        "pace_max_archive_backlog_segments",
        "archive_backlog_segments",
        64,
        "more than this many WAL segments wait for the archiver (when archive_mode is on)",
        column="archive_backlog",
        integer=True,
    ),
    Limit(
        "pace_max_lock_waiters",
        "lock_waiters",
        1,
        "more than this many sessions were waiting for the job's row locks at the end of the "
        "last batch",
        integer=True,
    ),
)


@dataclass(frozen=True)
class Reading:
    """One signal over its limit: its value, the limit and what it is about."""

    signal: str
    value: float
    limit: float
    about: str = ""

    def __str__(self) -> str:
        about = f" ({self.about})" if self.about else ""
        if self.signal == "vacuum":
            return f"vacuum=running{about}"
        if self.signal == "replica_unreachable":
            return f"replica_unreachable{about}"
        return f"{self.signal}={_fmt(self.value)} over {_fmt(self.limit)}{about}"


def _fmt(x: float) -> str:
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.2f}"


@dataclass
class Pause:
    """What a range's wait before a batch did: seconds paused and the signals that caused it."""

    seconds: float = 0.0
    signals: list[str] = field(default_factory=list)

    def attributes(self) -> dict[str, Any]:
        if not self.signals:
            return {}
        return {
            "pin.batch.paused_ms": round(self.seconds * 1000),
            "pin.batch.pause_signals": ",".join(self.signals),
        }


@dataclass
class Health:
    """A range's health checker: the run's limits (0 or False: off), the tables its batches
    write (the vacuum signal) and the dag id (the metric's tag)."""

    limits: dict[str, float]  # signal -> limit
    tables: tuple[str, ...] = ()
    dag_id: str = ""
    replicas: tuple[str, ...] = ()  # named replicas' connection ids (none: pg_stat_replication)
    _replica_conns: dict = field(default_factory=dict)  # connection id -> open connection
    _wal: deque = field(default_factory=deque)  # (monotonic seconds, WAL bytes)
    _waiters: tuple[int, float] = (0, 0.0)  # at the end of the last batch: count, longest wait
    _blind_warned: bool = False
    refresh: Callable[[], None] | None = None  # updates limits before each reading

    @classmethod
    def from_opts(cls, opts: dict[str, Any], tables=(), dag_id: str = "") -> Health:
        """The checker of a run's options (a missing param takes its default)."""
        limits = {}
        for lim in LIMITS:
            value = opts.get(lim.param, lim.default)
            if value:
                limits[lim.signal] = float(value)
        return cls(limits, tuple(tables), dag_id, tuple(opts.get(REPLICAS_PARAM) or ()))

    @property
    def on(self) -> bool:
        return bool(self.limits)

    # ------------------------------------------------------------------ inside a batch
    def sample_lock_waiters(self, cur) -> None:
        """In the batch's transaction, after its writes: who waits for the batch's locks."""
        if "lock_waiters" not in self.limits:
            return
        cur.execute(sql("health/lock_waiters"))
        row = cur.fetchone()
        self._waiters = (int(row[0]), float(row[1]))

    # ---------------------------------------------------------------- between batches
    def read(self, conn, lease=None, budget_share: float = 1.0) -> tuple[list[Reading], Any]:
        """The signals over their limits now (read in a transaction of their own), and the
        seconds left of the range's budget (None without a lease: unbounded)."""
        params = {
            "tables": list(self.tables),
            "lock_key": lease.lock_key if lease else "",
            "token": lease.token if lease else -1,
            "budget_share": budget_share,
        }
        with transaction(conn) as cur:
            cur.execute(sql("health/signals"), params)
            row = fetch_one_dict(cur)
        if not row["can_read_stats"] and not self._blind_warned and self.limits:
            self._blind_warned = True
            log.warning(
                "pacing cannot see replica lag or vacuum progress: the job's role lacks "
                "pg_read_all_stats (include/sql/schema/roles.sql grants it)"
            )
        left = None if lease is None else row["seconds_left"] or 0.0
        return self._over(row, time.monotonic()), left

    def _over(self, row: dict[str, Any], now: float) -> list[Reading]:
        """The signals of a ``health/signals`` row (and the range's own) over their limits."""
        over: list[Reading] = []

        def check(signal: str, value, about: str = "") -> None:
            limit = self.limits.get(signal)
            if limit is not None and value is not None and value > limit:
                over.append(Reading(signal, value, limit, about))

        if self.replicas:
            over += self._named_replicas(row["wal_bytes"])
        else:
            check("replica_lag_seconds", row["replica_lag_seconds"], row["replica_lag_seconds_of"])
            lag = row["replica_lag_bytes"]
            check("replica_lag_mb", lag and lag / MB, row["replica_lag_bytes_of"])
        if row["vacuum"] and "vacuum" in self.limits:
            over.append(Reading("vacuum", 1, 0, row["vacuum"]))
        check("wal_mb_per_second", self._wal_rate(now, float(row["wal_bytes"])))
        for lim in LIMITS:
            if lim.column is not None:
                check(lim.signal, row[lim.column])
        waiters, longest = self._waiters
        check("lock_waiters", waiters, f"longest wait {longest:.2f} s at the last batch's end")
        self._waiters = (0, 0.0)  # a waiter is counted once; the pause has let it through
        return over

    def _named_replicas(self, primary_bytes: float) -> list[Reading]:
        """The named replicas over a replica-lag limit (or unreachable), each read on its own
        connection after the primary's WAL position (so a lag is never overstated)."""
        seconds, mb = self.limits.get("replica_lag_seconds"), self.limits.get("replica_lag_mb")
        if seconds is None and mb is None:
            return []
        over = []
        for conn_id in self.replicas:
            row = self._read_replica(conn_id)
            if isinstance(row, str):
                over.append(Reading("replica_unreachable", 1, 0, f"{conn_id}: {row}"))
                continue
            lag_mb = max(primary_bytes - float(row["replay_bytes"]), 0.0) / MB
            if seconds is not None and row["lag_seconds"] > seconds:
                over.append(Reading("replica_lag_seconds", row["lag_seconds"], seconds, conn_id))
            if mb is not None and lag_mb > mb:
                over.append(Reading("replica_lag_mb", lag_mb, mb, conn_id))
        return over

    def _read_replica(self, conn_id: str) -> dict[str, Any] | str:
        """A named replica's replay position (``health/replica``), or why it cannot be read
        (its connection is opened again at the next reading)."""
        try:
            conn = self._replica_conns.get(conn_id) or connect(conn_id)
            self._replica_conns[conn_id] = conn
            with transaction(conn) as cur:
                cur.execute(sql("health/replica"))
                row = fetch_one_dict(cur)
        except Exception as exc:
            if not from_database(exc):
                raise
            self._drop_replica(conn_id)
            return first_line(exc)
        if not row["in_recovery"]:
            return "not a replica (pg_is_in_recovery() is false)"
        return row

    def _drop_replica(self, conn_id: str) -> None:
        conn = self._replica_conns.pop(conn_id, None)
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001, S110 - already broken
                pass

    def close(self) -> None:
        """Close the named replicas' connections."""
        for conn_id in list(self._replica_conns):
            self._drop_replica(conn_id)

    def __enter__(self) -> Health:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _wal_rate(self, now: float, wal_bytes: float) -> float | None:
        """MB/s written over the last :data:`WAL_WINDOW_S` (at least :data:`MIN_WAL_SPAN_S`);
        None until there are two readings."""
        samples = self._wal
        samples.append((now, wal_bytes))
        while len(samples) > 2 and now - samples[1][0] >= WAL_WINDOW_S:
            samples.popleft()
        t0, b0 = samples[0]
        if len(samples) < 2:
            return None
        return (wal_bytes - b0) / MB / max(now - t0, MIN_WAL_SPAN_S)

    def _wal_wait(self) -> float:
        """How long the WAL window needs to fall to the limit, were nothing more written."""
        if len(self._wal) < 2 or "wal_mb_per_second" not in self.limits:
            return MAX_PAUSE_S
        (t0, b0), (t1, b1) = self._wal[0], self._wal[-1]
        return (b1 - b0) / MB / self.limits["wal_mb_per_second"] - (t1 - t0)

    def wait(self, conn, lease=None, budget_share: float = 1.0, stop=None, label="") -> Pause:
        """Before a batch, outside any transaction: return once every signal is under its
        limit, the range's budget is spent, or a stop is requested; what it paused. ``label``
        names what waits in the log (``range ...``, ``retention``)."""
        pause = Pause()
        step, started = FIRST_PAUSE_S, time.monotonic()
        while self._refreshed().on:  # limits given mid-run take effect while it waits
            over, left = self.read(conn, lease, budget_share)
            if not over:
                if pause.signals:
                    pause.seconds = time.monotonic() - started
                    why = ", ".join(pause.signals)
                    log.info("%s resumes after %.1f s paused (%s)", label, pause.seconds, why)
                return pause
            self._count(pause, over)
            if left is not None and left <= 0:
                log.warning("%s: budget spent while paused (%s); it stops here", label, _all(over))
                break
            sleep = step
            if all(r.signal == "wal_mb_per_second" for r in over):
                sleep = min(step, max(self._wal_wait(), 0.05))
            sleep = sleep if left is None else min(sleep, left)
            log.warning(
                "pausing: %s; %s rechecks in %.1f s (paused %.1f s so far)",
                _all(over),
                label,
                sleep,
                time.monotonic() - started,
            )
            if sleep_unless_stopped(sleep, stop):
                break
            step = min(step * 2, MAX_PAUSE_S)
        pause.seconds = time.monotonic() - started if pause.signals else 0.0
        return pause

    def _refreshed(self) -> Health:
        if self.refresh is not None:
            self.refresh()
        return self

    def _count(self, pause: Pause, over: list[Reading]) -> None:
        """Note the signals a pause is for, each counted once in the pauses metric."""
        for r in over:
            if r.signal not in pause.signals:
                pause.signals.append(r.signal)
                metrics.incr(METRIC, tags={"dag_id": self.dag_id, "signal": r.signal})


def _all(over: list[Reading]) -> str:
    return "; ".join(map(str, over))


def sleep_unless_stopped(seconds: float, stop) -> bool:
    """Sleep, waking early when a stop is requested; whether one was."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        if stop is not None and stop.requested:
            return True
        time.sleep(min(left, 0.2))
    return bool(stop is not None and stop.requested)
