"""Hot-path simulator of the news service (INV-CMT-005), for load tests of news_comment_reconcile.

N threads, each with its own psycopg connection, run as fast as they can one short transaction
after another, as the news service does when a comment is written:

- *create*: insert a ``Visible`` comment and ``comments_count = comments_count + 1`` on its post;
- *remove*: hide or delete a ``Visible`` comment (``HiddenByModerator`` / ``DeletedByAuthor``,
  ``updated_at = now()``) and ``comments_count = comments_count - 1``.

A share of the transactions goes to a few *hot* posts (row-lock contention with the job), the
rest is spread over all posts. Every transaction keeps a post's drift (``comments_count`` minus
its visible comments) unchanged: a correct counter stays correct, an injected drift stays as it
was, unless the job corrects it.

The simulator counts committed transactions and failures (any exception: the hot path must
never fail because of the job; waiting for a row lock is not a failure), and measures how long
the counter UPDATE took (it waits there while the job holds the post's row lock).

    python -m tools.hotpath --dsn postgresql://... --seconds 10 --threads 4

:func:`fixed_rate` (``--rate``) is the benchmark's open-loop mode: news and catalog transactions
at a fixed rate each, every transaction's latency counted from its scheduled start (so a stall
shows up in the transactions queued behind it), and the time of the row-lock statement (the
counter UPDATE / the view increment) recorded on its own. The news transactions remove only
comments they created themselves, so that the data can be put back afterwards (delete the
comments created after the data's instant, restore the counters).
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

import psycopg

from tools.datagen import uuid7

REMOVED = ("HiddenByModerator", "DeletedByAuthor")

INSERT_COMMENT = (
    "INSERT INTO news.comments (id, post_id, status, created_at, updated_at) "
    "VALUES (%s, %s, 'Visible', now(), now())"
)
REMOVE_COMMENT = (
    "UPDATE news.comments SET status = %s, updated_at = now() "
    "WHERE id = (SELECT id FROM news.comments "
    "            WHERE post_id = %s AND status = 'Visible' "
    "            LIMIT 1 FOR UPDATE SKIP LOCKED) "
    "RETURNING id"
)
INCREMENT = "UPDATE news.posts SET comments_count = comments_count + 1 WHERE id = %s"
DECREMENT = "UPDATE news.posts SET comments_count = comments_count - 1 WHERE id = %s"

# a counter UPDATE slower than this is counted as having waited for a row lock
WAIT_THRESHOLD_S = 0.005


@dataclass
class ThreadStats:
    committed: int = 0
    creates: int = 0
    removes: int = 0
    failures: list[str] = field(default_factory=list)
    counter_update_s: float = 0.0
    max_counter_update_s: float = 0.0
    waits: int = 0
    touched: set[str] = field(default_factory=set)
    commit_times: list[float] = field(default_factory=list)  # time.time() of each commit


@dataclass
class HotPathStats:
    threads: int
    elapsed_s: float
    committed: int
    creates: int
    removes: int
    failures: list[str]
    counter_update_s: float
    max_counter_update_ms: float
    waits: int
    touched: set[str]
    commit_times: list[float]

    @property
    def tps(self) -> float:
        return self.committed / self.elapsed_s if self.elapsed_s else 0.0

    def committed_between(self, start: float, end: float) -> int:
        """Transactions committed in the wall-clock interval [start, end] (time.time())."""
        return sum(1 for t in self.commit_times if start <= t <= end)

    def brief(self) -> dict:
        return {
            "threads": self.threads,
            "elapsed_s": round(self.elapsed_s, 2),
            "committed": self.committed,
            "creates": self.creates,
            "removes": self.removes,
            "tps": round(self.tps),
            "failures": len(self.failures),
            "waits_over_5ms": self.waits,
            "max_counter_update_ms": round(self.max_counter_update_ms, 1),
            "posts_touched": len(self.touched),
        }


class HotPath:
    """Run the simulated hot path in background threads: ``start()`` ... ``stop()``."""

    def __init__(
        self,
        dsn: str,
        post_ids: Sequence[str],
        hot_ids: Sequence[str] = (),
        threads: int = 4,
        hot_share: float = 0.5,
        remove_share: float = 0.4,
        seed: int = 1,
        record_touched: bool = True,
    ):
        if not post_ids:
            raise ValueError("the hot path needs posts to write to")
        self.dsn = dsn
        self.post_ids = list(post_ids)
        self.hot_ids = list(hot_ids)
        self.n_threads = threads
        self.hot_share = hot_share if self.hot_ids else 0.0
        self.remove_share = remove_share
        self.seed = seed
        self.record_touched = record_touched
        self._stop = threading.Event()
        self._ready = threading.Barrier(threads + 1)
        self._threads: list[threading.Thread] = []
        self._stats = [ThreadStats() for _ in range(threads)]
        self._started = 0.0
        self._stopped = 0.0

    # -- control -------------------------------------------------------------------------
    def start(self, timeout: float = 30) -> HotPath:
        for i in range(self.n_threads):
            t = threading.Thread(target=self._work, args=(i,), name=f"hotpath-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        try:
            self._ready.wait(timeout)  # every thread is connected
        except threading.BrokenBarrierError:
            self._stop.set()
            raise RuntimeError(
                f"hot path did not start: {[f for s in self._stats for f in s.failures]}"
            ) from None
        self._started = time.time()
        return self

    def committed(self) -> int:
        """Transactions committed so far (a racy read, good enough for progress)."""
        return sum(s.committed for s in self._stats)

    def stop(self, timeout: float = 30) -> HotPathStats:
        self._stop.set()
        for t in self._threads:
            t.join(timeout)
        alive = [t.name for t in self._threads if t.is_alive()]
        self._stopped = time.time()
        stats = self._merge()
        if alive:
            stats.failures.append(f"threads still running after {timeout}s: {alive}")
        return stats

    def __enter__(self) -> HotPath:
        return self.start()

    def __exit__(self, *exc) -> None:
        if not self._stop.is_set():
            self.stop()

    # -- the work ------------------------------------------------------------------------
    def _work(self, idx: int) -> None:
        st = self._stats[idx]
        rnd = random.Random(self.seed * 1000 + idx)
        try:
            conn = psycopg.connect(self.dsn, autocommit=False)
        except Exception as exc:  # noqa: BLE001
            st.failures.append(f"connect: {exc!r}")
            self._ready.abort()
            return
        try:
            self._ready.wait()
        except threading.BrokenBarrierError:
            conn.close()
            return
        try:
            while not self._stop.is_set():
                post = (
                    rnd.choice(self.hot_ids)
                    if rnd.random() < self.hot_share
                    else rnd.choice(self.post_ids)
                )
                try:
                    self._one(conn, st, rnd, post)
                except Exception as exc:  # noqa: BLE001 - every failure is counted
                    if len(st.failures) < 50:
                        st.failures.append(f"{type(exc).__name__}: {exc}".strip())
                    try:
                        conn.rollback()
                    except Exception:  # noqa: BLE001 - a broken connection: reconnect
                        conn.close()
                        conn = psycopg.connect(self.dsn, autocommit=False)
        finally:
            conn.close()

    def _one(self, conn, st: ThreadStats, rnd: random.Random, post: str) -> None:
        with conn.cursor() as cur:
            removed = False
            if rnd.random() < self.remove_share:
                cur.execute(REMOVE_COMMENT, (rnd.choice(REMOVED), post))
                removed = cur.fetchone() is not None
            if not removed:
                cur.execute(INSERT_COMMENT, (str(uuid7(datetime.now(UTC), rnd)), post))
            t0 = time.perf_counter()
            cur.execute(DECREMENT if removed else INCREMENT, (post,))
            took = time.perf_counter() - t0
            if cur.rowcount != 1:
                raise RuntimeError(f"post {post} not found")
        conn.commit()
        st.commit_times.append(time.time())
        st.committed += 1
        if removed:
            st.removes += 1
        else:
            st.creates += 1
        st.counter_update_s += took
        st.max_counter_update_s = max(st.max_counter_update_s, took)
        st.waits += took > WAIT_THRESHOLD_S
        if self.record_touched:
            st.touched.add(post)

    def _merge(self) -> HotPathStats:
        s = self._stats
        return HotPathStats(
            threads=self.n_threads,
            elapsed_s=(self._stopped or time.time()) - self._started,
            committed=sum(x.committed for x in s),
            creates=sum(x.creates for x in s),
            removes=sum(x.removes for x in s),
            failures=[f for x in s for f in x.failures],
            counter_update_s=sum(x.counter_update_s for x in s),
            max_counter_update_ms=max((x.max_counter_update_s for x in s), default=0) * 1000,
            waits=sum(x.waits for x in s),
            touched=set().union(*(x.touched for x in s)),
            commit_times=sorted(t for x in s for t in x.commit_times),
        )


def _child(kwargs: dict, ready, stop, progress, out) -> None:
    try:
        hp = HotPath(**kwargs).start()
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        out.put(repr(exc))
        ready.set()
        return
    ready.set()
    while not stop.wait(0.05):
        progress.value = hp.committed()
    out.put(hp.stop())


class HotPathProcess:
    """:class:`HotPath` in a process of its own (same interface): the simulated service and the
    process running the job then do not share a Python interpreter lock, as in production."""

    def __init__(self, dsn: str, post_ids: Sequence[str], hot_ids: Sequence[str] = (), **kwargs):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._ready, self._stop = ctx.Event(), ctx.Event()
        self._progress = ctx.Value("q", 0, lock=False)
        self._out = ctx.Queue()
        self._proc = ctx.Process(
            target=_child,
            daemon=True,
            name="hotpath",
            args=(
                {"dsn": dsn, "post_ids": list(post_ids), "hot_ids": list(hot_ids), **kwargs},
                self._ready,
                self._stop,
                self._progress,
                self._out,
            ),
        )

    def start(self, timeout: float = 60) -> HotPathProcess:
        self._proc.start()
        if not self._ready.wait(timeout):
            self._proc.kill()
            raise RuntimeError(f"hot path process did not start within {timeout}s")
        if not self._out.empty():
            raise RuntimeError(f"hot path did not start: {self._out.get()}")
        return self

    def committed(self) -> int:
        return int(self._progress.value)

    def stop(self, timeout: float = 60) -> HotPathStats:
        self._stop.set()
        try:
            stats = self._out.get(timeout=timeout)
        finally:
            self._proc.join(timeout)
            if self._proc.is_alive():
                self._proc.kill()
        if not isinstance(stats, HotPathStats):
            raise RuntimeError(f"hot path failed: {stats}")
        return stats

    def __enter__(self) -> HotPathProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        if not self._stop.is_set():
            self.stop()


CARD_VIEW = (
    "UPDATE catalog.property_object_cards SET popularity_views = popularity_views + 1 WHERE id = %s"
)


PICK = {
    "news": (
        "SELECT id FROM news.posts TABLESAMPLE SYSTEM (5) "
        "WHERE status IS DISTINCT FROM 'Archived' LIMIT 20000",
        "SELECT id FROM news.posts WHERE status IS DISTINCT FROM 'Archived' "
        "ORDER BY id DESC LIMIT 200",
    ),
    "catalog": (
        "SELECT id FROM catalog.property_object_cards TABLESAMPLE SYSTEM (5) "
        "WHERE status IS DISTINCT FROM 'Delisted' AND popularity_views >= 0 LIMIT 20000",
        "SELECT id FROM catalog.property_object_cards "
        "WHERE status IS DISTINCT FROM 'Delisted' AND popularity_views >= 0 "
        "ORDER BY id DESC LIMIT 200",
    ),
}


def _pick_ids(dsn: str, kind: str) -> tuple[list, list]:
    """A random sample of the live rows and the 200 newest ones (the hot set)."""
    with psycopg.connect(dsn) as conn:
        return tuple([r[0] for r in conn.execute(q)] for q in PICK[kind])


def fixed_rate(
    dsns: dict[str, str], rate: float, stop: threading.Event, threads: int = 3, seed: int = 1
) -> dict[str, list[tuple[float, float, float]]]:
    """Run ``rate`` transactions per second of each kind in ``dsns`` ("news", "catalog") until
    ``stop`` is set; half of them on the 200 newest rows. Returns, per kind, (scheduled start
    as time.time(), latency ms from the scheduled start, row-lock statement ms) of each
    transaction; a failure has latency -1. Under "pids", the backend pids of each kind: their
    row-lock waits longer than 5 ms are in the server log (``log_lock_waits``; superuser)."""
    out: dict[str, list] = {k: [] for k in dsns}
    pids: dict[str, list] = {k: [] for k in dsns}
    workers = []
    for kind, dsn in dsns.items():
        sample, hot = _pick_ids(dsn, kind)
        for i in range(threads):
            args = (kind, dsn, sample, hot, rate / threads, i / rate, stop, out[kind], seed + i)
            args += (pids[kind],)
            workers.append(threading.Thread(target=_paced, args=args, daemon=True))
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return {**{k: sorted(v) for k, v in out.items()}, "pids": pids}


def _paced(kind, dsn, sample, hot, rate, offset, stop, out, seed, pids) -> None:
    rnd = random.Random(seed)
    mine: list = []  # comments this thread created and has not removed yet
    conn = psycopg.connect(dsn, autocommit=True)
    conn.execute("SET log_lock_waits = on")
    conn.execute("SET deadlock_timeout = '5ms'")
    conn.autocommit = kind == "catalog"
    pids.append(conn.info.backend_pid)
    due = time.time() + 0.5 + offset
    while not stop.is_set():
        if (pause := due - time.time()) > 0:
            time.sleep(pause)
        row = rnd.choice(hot) if rnd.random() < 0.5 else rnd.choice(sample)
        try:
            with conn.cursor() as cur:
                if kind == "catalog":
                    t = time.perf_counter()
                    cur.execute(CARD_VIEW, (row,))
                    lock_s = time.perf_counter() - t
                else:
                    if mine and rnd.random() < 0.4:
                        cid, row = mine.pop(rnd.randrange(len(mine)))
                        cur.execute(
                            "UPDATE news.comments SET status = 'HiddenByModerator', "
                            "updated_at = now() WHERE id = %s",
                            (cid,),
                        )
                        counter = DECREMENT
                    else:
                        cid = uuid7(datetime.now(UTC), rnd)
                        cur.execute(INSERT_COMMENT, (cid, row))
                        mine.append((cid, row))
                        counter = INCREMENT
                    t = time.perf_counter()
                    cur.execute(counter, (row,))
                    lock_s = time.perf_counter() - t
                    conn.commit()
            out.append((due, (time.time() - due) * 1000, lock_s * 1000))
        except Exception:  # noqa: BLE001 - counted as a failure
            out.append((due, -1.0, 0.0))
            conn.rollback()
        due += 1 / rate
    conn.close()


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsn", required=True, help="libpq DSN of the news database")
    ap.add_argument("--catalog-dsn", help="with --rate: the catalog database too")
    ap.add_argument(
        "--rate",
        type=float,
        help="open-loop mode: this many transactions per second of each kind, until stdin "
        "closes; prints every transaction as JSON",
    )
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--hot", type=int, default=8, help="number of hot posts")
    ap.add_argument("--hot-share", type=float, default=0.5)
    ap.add_argument("--remove-share", type=float, default=0.4)
    ap.add_argument("--posts", type=int, default=10000, help="posts to spread over (newest)")
    args = ap.parse_args(argv)
    if args.rate:
        import sys

        stop = threading.Event()
        dsns = {"news": args.dsn, **({"catalog": args.catalog_dsn} if args.catalog_dsn else {})}
        threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
        print(json.dumps(fixed_rate(dsns, args.rate, stop)), flush=True)
        return
    with psycopg.connect(args.dsn) as conn:
        ids = [
            r[0]
            for r in conn.execute(
                "SELECT id::text FROM news.posts WHERE status IS DISTINCT FROM 'Archived' "
                "ORDER BY id DESC LIMIT %s",
                (args.posts,),
            )
        ]
    rnd = random.Random(0)
    hp = HotPath(
        args.dsn,
        ids,
        rnd.sample(ids, min(args.hot, len(ids))),
        threads=args.threads,
        hot_share=args.hot_share,
        remove_share=args.remove_share,
        record_touched=False,
    ).start()
    time.sleep(args.seconds)
    stats = hp.stop()
    print(json.dumps(stats.brief(), indent=2))
    for f in stats.failures[:10]:
        print("failure:", f)


if __name__ == "__main__":
    main()
