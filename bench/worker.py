"""A worker process: works through keyset ranges with the project's code, as a mapped task does.

Started by :mod:`bench.runners` (``python -m bench.worker DSN``), one process per parallel range
(its own connection, made as ``PostgresHook.get_conn()`` makes it), so that its peak memory is
its own. Protocol, JSON lines: it answers ``{"rss_kb"}`` once imported and connected; then per
task line ``{"job", "rng", "lease", "opts", "run_id", "candidate_mode" | "kind"}`` it runs
``pin_nightly.ranges.run_range`` with the job's ``make_batch`` and answers the range result,
the per-batch transaction times, how long each transaction held row locks, and the time per
statement (by SQL file); an empty line ends it (answer: ``{"hwm_kb"}``).

Measured by a thin proxy around the connection: a batch transaction's time is from its first
statement to the return of its COMMIT; its row locks are held at most from the start of its
first statement that takes them (``LOCK_STATEMENTS``) to the return of its COMMIT, for a batch
and for the end-of-range retry of a skipped row alike.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

# the statements that take a transaction's row locks (the catalog's compute takes none)
LOCK_STATEMENTS = {
    "news/full_lock",
    "news/candidate_lock",
    "news/ids_lock",
    "catalog/apply",
    "catalog/lock",
}


def status_kb(field: str) -> int | None:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None


class Profile:
    """Per statement: [calls, seconds]; per batch transaction: milliseconds; per transaction
    that held row locks: milliseconds from its first locking statement to its COMMIT."""

    def __init__(self, labels: dict[str, str], placeholders: dict[str, str]) -> None:
        self.labels = labels
        self.placeholders = placeholders  # text put in by the job code: its placeholder
        self.reset()

    def reset(self) -> None:
        self.stmt: dict[str, list] = defaultdict(lambda: [0, 0.0])
        self.tx_start: float | None = None
        self.tx_locks: float | None = None  # start of the transaction's first lock statement
        self.tx_batch = False  # the transaction advanced a range cursor: a batch
        self.batch_ms: list[float] = []
        self.lock_ms: list[float] = []

    def label(self, query) -> str:
        q = str(query)
        for table in ("catalog.property_object_cards", "catalog.project_cards"):
            q = q.replace(table, "{cards}")
        for text, placeholder in self.placeholders.items():
            q = q.replace(text, placeholder)
        return self.labels.get(str(query)) or self.labels.get(q) or "other: " + q.split()[0]

    def add(self, label: str, t0: float, t1: float) -> None:
        s = self.stmt[label]
        s[0] += 1
        s[1] += t1 - t0
        if label in ("COMMIT", "ROLLBACK"):
            if self.tx_start is not None and self.tx_batch and label == "COMMIT":
                self.batch_ms.append((t1 - self.tx_start) * 1000)
            if self.tx_locks is not None:
                self.lock_ms.append((t1 - self.tx_locks) * 1000)
            self.tx_start, self.tx_locks, self.tx_batch = None, None, False
        else:
            self.tx_start = t0 if self.tx_start is None else self.tx_start
            if label in LOCK_STATEMENTS and self.tx_locks is None:
                self.tx_locks = t0
            self.tx_batch |= label == "common/range_advance"


class Proxy:
    """Wraps a connection or a cursor: times ``execute``, ``commit`` and ``rollback``."""

    def __init__(self, target, prof: Profile) -> None:
        self._t, self._p = target, prof

    def cursor(self, *a, **kw):
        return Proxy(self._t.cursor(*a, **kw), self._p)

    def _timed(self, label: str, fn, *a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            self._p.add(label, t, time.perf_counter())

    def execute(self, query, params=None, **kw):
        return self._timed(self._p.label(query), self._t.execute, query, params, **kw)

    def commit(self):
        return self._timed("COMMIT", self._t.commit)

    def rollback(self):
        return self._timed("ROLLBACK", self._t.rollback)

    def __getattr__(self, name):
        return getattr(self._t, name)


def main() -> None:
    out = os.fdopen(os.dup(1), "w")  # the protocol; what libraries print goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(obj) -> None:
        out.write(json.dumps(obj, default=str) + "\n")
        out.flush()

    import psycopg
    from psycopg.types.json import register_default_adapters

    from pin_nightly import catalog, db, lease, news, ranges, runs, sweeps

    labels: dict[str, str] = {}  # SQL text -> file name, as the job code asks for them
    original = db.sql

    def named(name: str) -> str:
        text = original(name)
        labels[text] = name
        return text

    for mod in (db, ranges, sweeps, runs, lease, news, catalog):
        if hasattr(mod, "sql"):
            mod.sql = named
    raw = psycopg.connect(sys.argv[1])
    register_default_adapters(raw)
    raw.autocommit = False
    db.bound_session(raw)  # the session settings of the job's own connections
    prof = Profile(labels, {original("common/uuid7_now"): "{uuid7_now}"})
    conn = Proxy(raw, prof)
    send({"rss_kb": status_kb("VmRSS")})
    for line in sys.stdin:
        if not line.strip():
            break
        task = json.loads(line)
        prof.reset()
        lease, opts = runs.Run.of(news.JOB, {}, "", task["lease"]).held(), task["opts"]
        if task["job"] == "news":
            batch = news.make_batch(
                opts, task["rng"]["sweep_id"], task["run_id"], candidate_mode=task["candidate_mode"]
            )
        else:
            batch = catalog.make_batch(task["kind"], opts, task["rng"]["sweep_id"], task["run_id"])
        res = ranges.run_range(conn, task["rng"], lease, opts["batch_size"], batch)
        raw.execute("SELECT pg_stat_force_next_flush()")  # WAL statistics, for the footprint
        raw.commit()
        send(
            {
                "result": res.__dict__,
                "batch_ms": prof.batch_ms,
                "lock_ms": prof.lock_ms,
                "statements": dict(prof.stmt),
                "hwm_kb": status_kb("VmHWM"),
            }
        )
    raw.close()
    send({"hwm_kb": status_kb("VmHWM")})


if __name__ == "__main__":
    main()
