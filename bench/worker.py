"""A worker process: works through keyset ranges with the project's code, as a mapped task does.

Started by :mod:`bench.runners` (``python -m bench.worker``), one process per parallel range
(its own connection), so that its peak memory is its own. Protocol: JSON lines on stdin/stdout.

- line 1 (config): ``{"dsn", "variant"}``; answers ``{"ready": true, "rss_kb": ...}`` once
  imported and connected (before the timed part begins);
- then one task per line: ``{"job": "news"|"catalog", "rng", "lease", "opts", "run_id",
  "candidate_mode" | "kind"}``; answers the range result, per-batch lock times and a
  per-statement profile;
- ``{"quit": true}``: answers ``{"hwm_kb": ...}`` and exits.

The batch functions are ``pin_nightly.news.make_batch`` / ``pin_nightly.catalog.make_batch``
and the loop is ``pin_nightly.keyset.run_range``, unchanged; a variant may only swap SQL texts
(``pin_nightly.db.sql``), the batch size or connection settings (see :mod:`bench.variants`).

Lock time of a batch = from the first statement of its transaction (the lease fence, which
opens it) to the return of its COMMIT, measured by a thin proxy around the connection. The
proxy also times every statement, by SQL file name.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from collections import defaultdict

from bench.common import read_status_kb

BATCH_LOCK_STATEMENTS = {"news/full_lock", "news/candidate_lock", "catalog/lock"}
CARD_TABLES = ("catalog.property_object_cards", "catalog.project_cards")


class Profile:
    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.stmt = defaultdict(lambda: [0, 0.0])  # label -> [count, seconds]
        self.tx_start: float | None = None
        self.tx_labels: list[str] = []
        self.batch_lock_ms: list[float] = []
        self.lock_stmt_ms: list[float] = []  # the lock statement of each batch, in order
        self.other_tx_ms: list[float] = []

    def label(self, query) -> str:
        q = str(query) if not isinstance(query, str) else query
        name = self.labels.get(q)
        if name is None:
            norm = q
            for t in CARD_TABLES:
                norm = norm.replace(t, "{cards}")
            name = self.labels.get(norm)
        if name is None:
            name = "other: " + re.sub(r"\s+", " ", q.strip())[:32]
        return name

    def executed(self, label: str, started: float, ended: float) -> None:
        if self.tx_start is None:
            self.tx_start = started
            self.tx_labels = []
        self.tx_labels.append(label)
        s = self.stmt[label]
        s[0] += 1
        s[1] += ended - started
        if label in BATCH_LOCK_STATEMENTS:
            self.lock_stmt_ms.append((ended - started) * 1000)

    def ended(self, kind: str, started: float, ended: float) -> None:
        s = self.stmt[kind]
        s[0] += 1
        s[1] += ended - started
        if self.tx_start is not None:
            ms = (ended - self.tx_start) * 1000
            if BATCH_LOCK_STATEMENTS.intersection(self.tx_labels) and kind == "COMMIT":
                self.batch_lock_ms.append(ms)
            else:
                self.other_tx_ms.append(ms)
        self.tx_start = None
        self.tx_labels = []


class ProfCursor:
    def __init__(self, cur, prof: Profile) -> None:
        self._cur = cur
        self._prof = prof

    def execute(self, query, params=None, **kw):
        t = time.perf_counter()
        try:
            return self._cur.execute(query, params, **kw)
        finally:
            self._prof.executed(self._prof.label(query), t, time.perf_counter())

    def __getattr__(self, name):
        return getattr(self._cur, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._cur.__exit__(*exc)


class ProfConn:
    def __init__(self, conn, prof: Profile) -> None:
        self._conn = conn
        self._prof = prof

    def cursor(self, *a, **kw):
        return ProfCursor(self._conn.cursor(*a, **kw), self._prof)

    def commit(self):
        t = time.perf_counter()
        try:
            return self._conn.commit()
        finally:
            self._prof.ended("COMMIT", t, time.perf_counter())

    def rollback(self):
        t = time.perf_counter()
        try:
            return self._conn.rollback()
        finally:
            self._prof.ended("ROLLBACK", t, time.perf_counter())

    def __getattr__(self, name):
        return getattr(self._conn, name)


class LockMsFromLog(logging.Handler):
    """The code's own per-batch figure (log line ``lock_ms=``), kept as a cross-check."""

    PATTERN = re.compile(r"lock_ms=([0-9.]+)")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.values: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        m = self.PATTERN.search(record.getMessage())
        if m:
            self.values.append(float(m.group(1)))


# The protocol's stream: the original stdout. File descriptor 1 is pointed at stderr in main(),
# so that what a library writes to stdout (Airflow's log lines) cannot break the protocol.
_PROTOCOL = sys.stdout


def send(obj) -> None:
    _PROTOCOL.write(json.dumps(obj, default=str) + "\n")
    _PROTOCOL.flush()


def main() -> None:
    global _PROTOCOL
    _PROTOCOL = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    cfg = json.loads(sys.stdin.readline())
    from bench import variants

    variant = variants.get(cfg["variant"])
    labels = variants.install(variant)

    import psycopg
    from psycopg.types.json import register_default_adapters

    from pin_nightly import catalog, jobs, keyset, news

    kw = (
        {}
        if variant.prepare_threshold == "default"
        else {"prepare_threshold": variant.prepare_threshold}
    )
    raw = psycopg.connect(cfg["dsn"], **kw)  # as PostgresHook.get_conn() makes it
    register_default_adapters(raw)
    raw.autocommit = False
    for stmt in variant.session:
        raw.execute(stmt)
    raw.commit()
    prof = Profile(labels)
    conn = ProfConn(raw, prof)
    klog = logging.getLogger("pin_nightly.keyset")
    klog.setLevel(logging.INFO)
    klog.propagate = False
    from_log = LockMsFromLog()
    klog.addHandler(from_log)
    warn = logging.StreamHandler(sys.stderr)
    warn.setLevel(logging.WARNING)
    klog.addHandler(warn)
    send({"ready": True, "rss_kb": read_status_kb("VmRSS"), "pid_note": "worker"})

    for line in sys.stdin:
        task = json.loads(line)
        if task.get("quit"):
            break
        prof.stmt.clear()
        prof.batch_lock_ms, prof.other_tx_ms, from_log.values = [], [], []
        prof.lock_stmt_ms = []
        lease = jobs.lease_from_xcom(task["lease"])
        opts = task["opts"]
        if task["job"] == "news":
            variants.install(variant, full_sweep=not task["candidate_mode"], labels=labels)
            batch = news.make_batch(
                opts, task["rng"]["sweep_id"], task["run_id"], candidate_mode=task["candidate_mode"]
            )
        else:
            batch = catalog.make_batch(task["kind"], opts)
        t0 = time.time()
        res = keyset.run_range(conn, task["rng"], lease, opts["batch_size"], batch)
        t1 = time.time()
        send(
            {
                "result": res.__dict__,
                "t_start": t0,
                "t_end": t1,
                "lock_ms": prof.batch_lock_ms,
                "lock_ms_log": from_log.values,
                "other_tx_ms": prof.other_tx_ms,
                "lock_stmt_ms": prof.lock_stmt_ms,
                "statements": {k: v for k, v in prof.stmt.items()},
                "rss_kb": read_status_kb("VmRSS"),
                "hwm_kb": read_status_kb("VmHWM"),
            }
        )
    raw.close()
    send({"hwm_kb": read_status_kb("VmHWM"), "rss_kb": read_status_kb("VmRSS")})


if __name__ == "__main__":
    main()
