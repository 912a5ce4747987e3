"""The partitions of ``catalog.popularity_daily_views``: one a night, created ahead of the
nights that write them, dropped whole past retention's horizon, and the online upgrade of the
previous release's table (one table) to that layout.

Why, and the upgrade's steps: docs/schema.md#popularity-snapshots. Every statement that takes a
strong lock runs under a short ``lock_timeout`` and is retried; nothing here locks a card table.
"""

from __future__ import annotations

import logging
import time
from datetime import date, timedelta
from typing import Any

from pin_nightly.db import JobConfigError, fetch_one_dict, sql, sqlstate, transaction

log = logging.getLogger(__name__)

TABLE = "catalog.popularity_daily_views"
AHEAD_DAYS = 7  # partitions created past tonight's: missed nights and the next week need none
LOCK_TIMEOUT_MS = 200  # each strong lock is waited for this long, then retried
DDL_ATTEMPTS = 20

# The step a DBA takes where the job's role may not change the table (docs/schema.md).
DBA_STEP = (
    "a DBA (the table's owner) upgrades it online: PYTHONPATH=plugins python -m "
    "pin_nightly.partitions '<dsn of the owner>', then applies include/sql/schema/roles.sql"
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


def prepare(conn) -> None:
    """Before a run writes: the previous release's table is upgraded (when this role owns
    it), else the run fails with the DBA's step and writes nothing."""
    state = layout(conn)
    if state is None or state["relkind"] is None or state["relkind"] == "p":
        if state and state["relkind"] == "p" and not state["functions"]:
            raise JobConfigError(
                f"{TABLE} is partitioned but its functions are missing: a DBA applies "
                "include/sql/schema/catalog_popularity.sql, then include/sql/schema/roles.sql"
            )
        return
    if not state["owner"]:
        raise JobConfigError(
            f"{TABLE} has the previous release's layout (one table, not partitioned) and this "
            f"role may not upgrade it; nothing was written: {DBA_STEP}"
        )
    migrate(conn)


def ensure(cur, as_of: date | str) -> int:
    """Create the partitions of ``as_of`` and the :data:`AHEAD_DAYS` nights after it that do
    not exist (a night inside the upgraded table's range has one), in the caller's transaction
    (a sweep's planning): creating and attaching a partition never waits for the job's own
    writes (SHARE UPDATE EXCLUSIVE). The number created."""
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
    passes use the whole budget; the rest is left to the next run. The snapshots dropped."""
    from pin_nightly import health as healths
    from pin_nightly import lease as leases

    pruned, past = 0, False
    with healths.Health.from_opts(opts, (TABLE,), "catalog_popularity_recompute") as pace:
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


def migrate(conn) -> dict[str, Any]:
    """Upgrade the previous release's table in place, online (include/sql/catalog/migrate.sql):
    build its (id, run_date) key concurrently, add and validate the check of its nights, then
    in one short transaction rename it aside, create the partitioned table and attach the old
    one as the partition of its nights, with the privileges it had. Every step may be
    interrupted and the next call goes on from there. Returns the legacy partition's range."""
    with transaction(conn) as cur:
        cur.execute(sql("catalog/migrate_facts"))
        facts = fetch_one_dict(cur)
    log.info("upgrading %s to the partitioned layout: %s", TABLE, facts)
    _build_indexes(conn, facts)
    _with_lock_timeout(conn, [(sql("catalog/migrate_range_check"), None)], "upgrade: check")
    with transaction(conn) as cur:
        cur.execute(sql("catalog/migrate_validate"))
    _with_lock_timeout(
        conn,
        [
            (sql("catalog/migrate_swap"), None),
            (sql("schema/catalog_popularity"), None),
            (sql("catalog/migrate_attach"), None),
        ],
        "upgrade: swap",
    )
    with transaction(conn) as cur:
        cur.execute(sql("catalog/legacy_range"))
        lo, hi = cur.fetchone()
    log.info("%s is partitioned; the previous table holds the nights %s to %s", TABLE, lo, hi)
    return {"lower_bound": lo, "upper_bound": hi}


def _build_indexes(conn, facts: dict[str, Any]) -> None:
    """The upgrade's indexes, each built concurrently (outside a transaction); an invalid one
    left by an interrupted build is dropped concurrently and built again."""
    autocommit = conn.autocommit
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            for valid, drop, build in (
                (facts["key_valid"], "migrate_drop_key", "migrate_key"),
                (facts["run_date_valid"], "migrate_drop_run_date", "migrate_run_date"),
            ):
                if valid is False:
                    cur.execute(sql(f"catalog/{drop}"))
                if valid is not True:
                    cur.execute(sql(f"catalog/{build}"))
    finally:
        conn.autocommit = autocommit


def main(argv: list[str] | None = None) -> int:
    """The DBA's step: ``python -m pin_nightly.partitions DSN`` upgrades the table online."""
    import sys

    import psycopg

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m pin_nightly.partitions '<dsn of the table owner>'")
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with psycopg.connect(args[0]) as conn:
        state = layout(conn)
        if state is None or state["relkind"] != "r":
            print(f"{TABLE}: nothing to upgrade (layout {state and state['relkind']})")
            return 0
        migrate(conn)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
