"""The partitions of ``catalog.popularity_daily_views``: one a night, created ahead of the
nights that write them, dropped whole past retention's horizon; the previous release's table
(one table), to which the job goes on writing its nights until it is upgraded; and that
upgrade, a DBA's command: ``PYTHONPATH=plugins python -m pin_nightly.partitions '<dsn>'``.

Why, and the upgrade's steps: docs/schema.md#popularity-snapshots. Every statement that takes a
strong lock runs under a short ``lock_timeout`` and is retried; nothing here locks a card table.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import date, timedelta
from typing import Any

from pin_nightly.db import (
    JobConfigError,
    fetch_one_dict,
    first_line,
    from_database,
    sql,
    sqlstate,
    transaction,
)

log = logging.getLogger(__name__)

TABLE = "catalog.popularity_daily_views"
AHEAD_DAYS = 7  # partitions created past tonight's: missed nights and the next week need none
LOCK_TIMEOUT_MS = 200  # each strong lock is waited for this long, then retried
DDL_ATTEMPTS = 20
PROGRESS_SECONDS = 10.0  # the upgrade command's progress lines, during a long step

COMMAND = "PYTHONPATH=plugins python -m pin_nightly.partitions '<dsn of the owner>'"
# The step a DBA takes to bring the previous release's table to this release's layout.
DBA_STEP = (
    f"a DBA (the table's owner) upgrades it online while the nights go on: {COMMAND}, then "
    "applies include/sql/schema/roles.sql"
)


def _date(value: date | str) -> date:
    return value if isinstance(value, date) else date.fromisoformat(value)


def _with_lock_timeout(conn, statements: list[tuple[str, dict | None]], what: str) -> list[Any]:
    """Run ``statements`` in one transaction whose locks are waited for at most
    :data:`LOCK_TIMEOUT_MS`; retried on a lock timeout (or a deadlock). Returns the first
    row of each statement (None when it returns none)."""
    for attempt in range(1, DDL_ATTEMPTS + 1):
        try:
            out = []
            with transaction(conn) as cur:
                cur.execute(sql("common/set_lock_timeout"), {"ms": str(LOCK_TIMEOUT_MS)})
                for text, params in statements:
                    if params is None:
                        cur.execute(text)
                    else:
                        cur.execute(text, params)
                    out.append(cur.fetchone() if cur.description else None)
            return out
        except Exception as exc:
            if sqlstate(exc) not in ("55P03", "40P01") or attempt == DDL_ATTEMPTS:
                raise
            log.info("%s: lock not granted within %d ms, retrying", what, LOCK_TIMEOUT_MS)
            time.sleep(min(0.05 * attempt, 1.0))
    raise AssertionError("unreachable")


def layout(conn) -> dict[str, Any]:
    with transaction(conn) as cur:
        cur.execute(sql("catalog/partition_layout"))
        return fetch_one_dict(cur)


def _relkind(cur) -> str | None:
    """The snapshot table's layout, in the caller's transaction: ``p`` partitioned, ``r`` the
    previous release's one table, None absent."""
    cur.execute(sql("catalog/partition_layout"))
    return cur.fetchone()[0]


def upgrade_state(conn) -> dict[str, Any]:
    """Where the upgrade of the previous release's table stands (``catalog/migrate_facts``)."""
    with transaction(conn) as cur:
        cur.execute(sql("catalog/migrate_facts"))
        return fetch_one_dict(cur)


def describe(facts: dict[str, Any]) -> str:
    """The upgrade's steps done so far, in words."""
    index = {True: "built", False: "left invalid by an interrupted build", None: "not built"}
    check = "not added"
    if facts["check_to"] is not None:
        done = "validated" if facts["check_valid"] else "added, not validated"
        last = facts["check_to"] - timedelta(days=1)
        check = f"{done} (nights {facts['check_from']} to {last})"
    return f"key index {index[facts['key_valid']]}, range check {check}"


def prepare(conn) -> None:
    """Before a run writes. A partitioned table needs its functions. On the previous release's
    table (one table) the run writes its night there, as that release did, and retention
    deletes batches of rows: the upgrade is a DBA's step (:func:`upgrade`), logged with how far
    it got. Only a night that the range check of an upgrade left interrupted rejects (more
    than a week later) is refused, before any write."""
    state = layout(conn)
    if state is None or state["relkind"] is None:
        return
    if state["relkind"] == "p":
        if not state["functions"]:
            raise JobConfigError(
                f"{TABLE} is partitioned but its functions are missing: a DBA applies "
                "include/sql/schema/catalog_popularity.sql, then include/sql/schema/roles.sql"
            )
        return
    facts = upgrade_state(conn)
    if facts["check_to"] is not None and facts["check_to"] <= facts["today"]:
        raise JobConfigError(
            f"{TABLE} has the previous release's layout and the range check of an upgrade left "
            f"interrupted admits no night after {facts['check_to'] - timedelta(days=1)}; "
            f"nothing was written: a DBA goes on with the upgrade ({COMMAND}) or drops the "
            "check (docs/runbook.md)"
        )
    log.warning(
        "%s has the previous release's layout (one table): the run writes its night to it and "
        "retention deletes batches of rows; %s (the upgrade so far: %s)",
        TABLE,
        DBA_STEP,
        describe(facts),
    )


def ensure(cur, as_of: date | str) -> int:
    """Create the partitions of ``as_of`` and the :data:`AHEAD_DAYS` nights after it that do
    not exist (a night inside the upgraded table's range has one), in the caller's transaction
    (a sweep's planning): creating and attaching a partition never waits for the job's own
    writes (SHARE UPDATE EXCLUSIVE). None on the previous release's table, which takes every
    night. The number created."""
    if _relkind(cur) != "p":
        return 0
    d = _date(as_of)
    cur.execute(
        sql("catalog/ensure_partitions"), {"from": d, "through": d + timedelta(days=AHEAD_DAYS)}
    )
    made = int(cur.fetchone()[0])
    if made:
        log.info("created %d partition(s) of %s from %s", made, TABLE, d)
    return made


def drop_oldest(conn, as_of: date | str, keep_days: int) -> dict[str, Any] | None:
    """Detach and drop the oldest partition whose nights are all past the horizon
    ``min(as_of, today) - (max(keep_days, 30) + 2)``; what it dropped, None when none."""
    params = {"as_of": _date(as_of), "keep_days": keep_days}
    (row,) = _with_lock_timeout(conn, [(sql("catalog/drop_partition"), params)], "retention")
    if row is None:
        return None
    dropped = dict(zip(("partition", "lower_bound", "upper_bound", "snapshots"), row))
    log.info(
        "retention: dropped %s (nights %s to %s, %d snapshot(s))",
        dropped["partition"],
        dropped["lower_bound"],
        dropped["upper_bound"] - timedelta(days=1),
        dropped["snapshots"],
    )
    return dropped


def prune(conn, lease, opts: dict[str, Any], keep_days: int) -> int:
    """Retention's drops until no partition is past the horizon, each in a transaction of its
    own after pacing on the database's health (as a range does), stopping at the run's
    deadline: past it, the oldest partition past the horizon that holds snapshots is still
    dropped, unpaced, with the empty ones before it (nights no run wrote: the partitions made a
    week ahead, across a gap), so the table never grows by more than a night on nights whose
    passes use the whole budget; the rest is left to the next run. On the previous release's
    table, batches of rows (:func:`_prune_rows`). The snapshots dropped."""
    from pin_nightly import health as healths
    from pin_nightly import lease as leases

    with transaction(conn) as cur:
        one_table = _relkind(cur) == "r"
    pruned, past = 0, False
    with healths.Health.from_opts(opts, (TABLE,), "catalog_popularity_recompute") as pace:
        if one_table:
            return _prune_rows(conn, lease, pace, opts, keep_days)
        while True:
            if not past:
                pace.wait(conn, lease, label="retention")  # outside any transaction
            with transaction(conn) as cur:
                past_deadline, renew_due = leases.fence(cur, lease)
            if past_deadline and not past:
                if not _last_drop(conn, opts["as_of_date"], keep_days, pruned):
                    return pruned
                past = True
            dropped = drop_oldest(conn, opts["as_of_date"], keep_days)
            if dropped is None:
                return pruned
            pruned += int(dropped["snapshots"])
            if past and dropped["snapshots"]:
                return pruned
            if renew_due:
                leases.renew(conn, lease)


def _prune_rows(conn, lease, pace, opts: dict[str, Any], keep_days: int) -> int:
    """Retention on the previous release's table (until its upgrade): the snapshots past the
    horizon deleted ``batch_size`` at a time, oldest nights first, each batch in a transaction
    of its own after pacing, fenced by the lease; at the run's deadline it stops and the next
    run deletes the rest. The snapshots deleted."""
    from pin_nightly import lease as leases

    limit = int(opts.get("batch_size") or 1000)
    params = {"as_of": opts["as_of_date"], "keep_days": keep_days, "limit": limit}
    pruned = 0
    while True:
        pace.wait(conn, lease, label="retention")  # outside any transaction
        with transaction(conn) as cur:
            past_deadline, renew_due = leases.fence(cur, lease)
            if not past_deadline:
                cur.execute(sql("catalog/prune_rows"), params)
                deleted = int(cur.fetchone()[0])
        if past_deadline:
            log.warning(
                "retention stopped at the run's deadline after %d snapshot(s); the next run "
                "deletes the rest",
                pruned,
            )
            return pruned
        pruned += deleted
        if deleted < limit:
            return pruned
        if renew_due:
            leases.renew(conn, lease)


def would_prune(cur, as_of: date | str, keep_days: int) -> int:
    """What retention would drop (a dry run), in the caller's transaction, on either layout:
    the snapshots of the partitions past the horizon, or the previous release's rows past it."""
    name = "catalog/retention_count" if _relkind(cur) == "p" else "catalog/rows_past_horizon"
    cur.execute(sql(name), {"as_of": _date(as_of), "keep_days": keep_days})
    return int(cur.fetchone()[0])


def _last_drop(conn, as_of: str, keep_days: int, pruned: int) -> bool:
    """Past the run's deadline: whether a partition past the horizon is left (the oldest that
    holds snapshots is dropped, then retention stops), logged either way."""
    with transaction(conn) as cur:
        cur.execute(sql("catalog/oldest_past_horizon"), {"as_of": as_of, "keep_days": keep_days})
        oldest = cur.fetchone()[0]
    if oldest is None:
        log.warning(
            "retention stopped at the run's deadline after %d snapshot(s); the next run prunes "
            "the rest",
            pruned,
        )
        return False
    log.warning(
        "retention: the run's deadline has passed after %d snapshot(s); it drops the oldest "
        "night past the horizon (%s) and leaves the rest to the next run (empty nights first: "
        "up to the oldest that holds snapshots)",
        pruned,
        oldest,
    )
    return True


def upgrade(dsn: str, every: float = PROGRESS_SECONDS) -> dict[str, Any] | None:
    """The DBA's command: upgrade the previous release's table online (:func:`migrate`), as
    its owner, in a session that no statement_timeout bounds (``catalog/upgrade_session``),
    saying every ``every`` seconds of a long step how far it got. The job goes on writing its
    nights meanwhile; run again after an interruption, it goes on from there. The legacy
    partition's range; None when there is nothing to upgrade."""
    import psycopg

    with psycopg.connect(dsn) as conn:
        state = layout(conn)
        if state["relkind"] != "r":
            found = "it is partitioned" if state["relkind"] == "p" else "it does not exist"
            log.info("%s: nothing to upgrade (%s)", TABLE, found)
            return None
        if not state["owner"]:
            raise JobConfigError(f"{TABLE} belongs to another role: upgrade it as its owner")
        with transaction(conn) as cur:
            cur.execute(sql("catalog/upgrade_session"))
        return migrate(conn, lambda what: _watching(dsn, conn, what, every))


def migrate(conn, watch: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """Upgrade the previous release's table in place, online (include/sql/catalog/migrate.sql):
    build its (id, run_date) key concurrently, add and validate the range check of its nights
    (up to the week after tonight), then in one short transaction rename it aside, create the
    partitioned table and attach the old one as the partition of those nights, with the
    privileges it had, and the partitions of tonight and the week after it that it does not
    hold. A step done is not done again and an interrupted one goes on: an index left invalid
    is dropped and built again, a range check added is validated. Each long step runs inside
    ``watch(what)`` (:func:`_watching`). Returns the legacy partition's range."""
    watch = watch or (lambda what: _watching(None, conn, what, PROGRESS_SECONDS))
    facts = upgrade_state(conn)
    log.info(
        "upgrading %s (%s, nights %s to %s); done so far: %s",
        TABLE,
        facts["size"],
        facts["oldest"],
        facts["newest"],
        describe(facts),
    )
    _build_indexes(conn, facts, watch)
    if facts["check_to"] is None:
        room = {"nights": str(AHEAD_DAYS)}
        checks = [(sql("catalog/migrate_room"), room), (sql("catalog/migrate_range_check"), None)]
        with watch("adding the range check of its nights, up to the week after tonight"):
            _with_lock_timeout(conn, checks, "upgrade: range check")
    if not facts["check_valid"]:
        with watch("validating the range check (a full scan)"), transaction(conn) as cur:
            cur.execute(sql("catalog/migrate_validate"))
    return _swap(conn)


def _swap(conn) -> dict[str, Any]:
    """The upgrade's last step, one short transaction (``lock_timeout``, retried): the old
    table renamed aside, the partitioned table created, the old one attached, the partitions
    ahead. The legacy partition's range."""
    log.info("upgrade: the swap, one short transaction: renamed aside, attached, partitions made")
    _with_lock_timeout(
        conn,
        [
            (sql("catalog/migrate_swap"), None),
            (sql("schema/catalog_popularity"), None),
            (sql("catalog/migrate_attach"), None),
            (sql("catalog/migrate_ahead"), {"nights": AHEAD_DAYS}),
        ],
        "upgrade: swap",
    )
    with transaction(conn) as cur:
        cur.execute(sql("catalog/legacy_range"))
        lo, hi = cur.fetchone()
    log.info(
        "%s is partitioned; the previous table holds the nights %s to %s",
        TABLE,
        lo,
        hi - timedelta(days=1),
    )
    return {"lower_bound": lo, "upper_bound": hi}


def _build_indexes(conn, facts: dict[str, Any], watch: Callable[[str], Any]) -> None:
    """The upgrade's indexes, each built concurrently (outside a transaction) unless it is
    already; one left invalid by an interrupted build is dropped concurrently, then built."""
    autocommit = conn.autocommit
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            for valid, name, drop, build in (
                (facts["key_valid"], "the key (id, run_date)", "migrate_drop_key", "migrate_key"),
                (
                    facts["run_date_valid"],
                    "ix_popularity_daily_run_date",
                    "migrate_drop_run_date",
                    "migrate_run_date",
                ),
            ):
                if valid is False:
                    with watch(f"dropping the invalid index of {name} an interrupted build left"):
                        cur.execute(sql(f"catalog/{drop}"))
                if valid is not True:
                    with watch(f"building the index of {name} concurrently"):
                        cur.execute(sql(f"catalog/{build}"))
    finally:
        conn.autocommit = autocommit


@contextmanager
def _watching(dsn: str | None, conn, what: str, every: float) -> Iterator[None]:
    """Log ``what`` as it starts and once it is done and, every ``every`` seconds from a second
    session (when ``dsn`` is given), how far it has got (:func:`_report`)."""
    started = time.monotonic()
    log.info("upgrade: %s", what)
    stop = threading.Event()
    if dsn:
        args = (dsn, conn.info.backend_pid, what, every, stop)
        threading.Thread(target=_report, args=args, daemon=True).start()
    try:
        yield
    finally:
        stop.set()
    log.info("upgrade: %s: done in %.1f s", what, time.monotonic() - started)


def _report(dsn: str, pid: int, what: str, every: float, stop: threading.Event) -> None:
    """Until ``stop``: every ``every`` seconds, what the session ``pid`` is doing, logged."""
    import psycopg

    try:
        with psycopg.connect(dsn, autocommit=True) as monitor:
            while not stop.wait(every):
                with monitor.cursor() as cur:
                    cur.execute(sql("catalog/upgrade_progress"), {"pid": pid})
                    row = fetch_one_dict(cur)
                if row and not stop.is_set():
                    log.info("upgrade: %s: %s", what, _progress(row))
    except Exception as exc:  # noqa: BLE001 - progress is a courtesy: the step goes on
        log.info("upgrade: no progress lines (%s)", first_line(exc))


def _progress(row: dict[str, Any]) -> str:
    """A progress line: how long the step's statement has run, an index build's phase and how
    much of it is done, a lock it waits for (a full scan has no progress view: its time)."""
    parts = [f"{row['seconds']} s"]
    if row["phase"]:
        parts.append(row["phase"])
    for unit in ("blocks", "tuples"):
        done, total = row[f"{unit}_done"], row[f"{unit}_total"]
        if total:
            parts.append(f"{done} of {total} {unit} ({100 * done // total} %)")
            break
    if row["wait_event_type"] == "Lock":
        parts.append(f"waiting for a lock ({row['wait_event']})")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    """The DBA's command, ``python -m pin_nightly.partitions DSN [--progress-seconds N]``:
    :func:`upgrade`. Interrupted, it says so; the same command then goes on from there."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m pin_nightly.partitions",
        description=f"Upgrade {TABLE} to the partitioned layout online (docs/schema.md).",
    )
    parser.add_argument("dsn", help="the connection string of the table's owner")
    parser.add_argument("--progress-seconds", type=float, default=PROGRESS_SECONDS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    try:
        upgrade(args.dsn, args.progress_seconds)
    except JobConfigError as exc:
        log.error("%s", exc)
        return 1
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - said plainly, then the cause
        log.error(
            "upgrade interrupted: %s. Nothing needs undoing and the job's nights go on: run the "
            "same command again, it goes on from where it stopped (docs/runbook.md)",
            first_line(exc),
            exc_info=not from_database(exc),
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
