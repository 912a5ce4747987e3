"""The single-flight lease: a row in PostgreSQL with a TTL and a fencing token.

Airflow's ``max_active_runs=1`` and the job pool keep runs of one deployment apart; the lease
keeps apart runs from anywhere (a second deployment, ``airflow dags test`` on a laptop). A run
that finds the lease held is skipped, not failed. Workers check the lease at the start of every
batch transaction (fencing) and renew it when less than half of its TTL is left.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

from pin_nightly.db import LeaseLost, fetch_one_dict, sql, transaction

__all__ = ["Lease", "LeaseHeld", "LeaseLost", "acquire", "fence", "renew", "release"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lease:
    lock_key: str
    holder: str
    token: int
    acquired_at: str
    run_deadline_at: str

    def to_xcom(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_xcom(cls, data: dict[str, Any]) -> "Lease":
        return cls(**data)


@dataclass(frozen=True)
class LeaseHeld:
    holder: str
    expires_at: str


def acquire(conn, lock_key: str, holder: str, ttl_minutes: float, max_run_minutes: float):
    """Take the lease; return :class:`Lease`, or :class:`LeaseHeld` when someone else has it."""
    params = {
        "lock_key": lock_key,
        "holder": holder,
        "ttl_minutes": ttl_minutes,
        "max_run_minutes": max_run_minutes,
    }
    with transaction(conn) as cur:
        cur.execute(sql("common/lease_acquire"), params)
        row = fetch_one_dict(cur)
        if row is None:
            cur.execute(sql("common/lease_holder"), params)
            other = fetch_one_dict(cur) or {"holder": "?", "expires_at": "?"}
            return LeaseHeld(holder=other["holder"], expires_at=str(other["expires_at"]))
    return Lease(
        lock_key=lock_key,
        holder=holder,
        token=int(row["token"]),
        acquired_at=row["acquired_at"].isoformat(),
        run_deadline_at=row["run_deadline_at"].isoformat(),
    )


def fence(cur, lease: Lease) -> tuple[bool, bool]:
    """Inside a batch transaction: raise :class:`LeaseLost` unless the lease is still ours.

    Returns ``(past_deadline, renew_due)``: whether the run's deadline has passed (no new batch
    may start) and whether less than half of the lease's TTL is left.
    """
    cur.execute(sql("common/lease_fence"), {"lock_key": lease.lock_key, "token": lease.token})
    row = cur.fetchone()
    if row is None:
        raise LeaseLost(
            f"lease {lease.lock_key!r} (token {lease.token}) expired or was taken over; "
            "stopping before the next write"
        )
    return bool(row[0]), bool(row[1])


def renew(conn, lease: Lease) -> None:
    with transaction(conn) as cur:
        cur.execute(sql("common/lease_renew"), {"lock_key": lease.lock_key, "token": lease.token})
        if cur.fetchone() is None:
            raise LeaseLost(f"lease {lease.lock_key!r} (token {lease.token}) could not be renewed")
    log.debug("renewed lease %s", lease.lock_key)


def release(conn, lease: Lease) -> bool:
    with transaction(conn) as cur:
        cur.execute(sql("common/lease_release"), {"lock_key": lease.lock_key, "token": lease.token})
        released = cur.fetchone() is not None
    if released:
        log.info("released lease %s (token %s)", lease.lock_key, lease.token)
    else:
        log.info("lease %s (token %s) was no longer ours: nothing to release",
                 lease.lock_key, lease.token)
    return released
