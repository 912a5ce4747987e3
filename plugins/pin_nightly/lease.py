"""The single-flight lease: a row in PostgreSQL with a TTL and a fencing token.

Airflow's ``max_active_runs=1`` and the job pool keep runs of one deployment apart; the lease
keeps apart runs from anywhere (a second deployment, ``airflow dags test`` on a laptop). A run
that finds the lease held is skipped, not failed. Workers check the lease at the start of every
batch transaction (fencing) and renew it when less than half of its TTL is left. A task of a
run whose lease is gone (released by the run's teardown after a failure, then the task cleared
on its own) takes it again for its run unless another run holds it (:func:`rejoin`).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, fields
from typing import Any

from pin_nightly.db import fetch_one_dict, sql, transaction

log = logging.getLogger(__name__)


class LeaseLost(RuntimeError):
    """The run's lease expired or was taken over: the worker must stop writing (fencing)."""


@dataclass(frozen=True)
class Lease:
    lock_key: str
    holder: str
    token: int
    acquired_at: str
    run_deadline_at: str
    ttl_minutes: float
    max_run_minutes: float

    def to_xcom(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_xcom(cls, data: dict[str, Any]) -> Lease:
        """The lease in ``data`` (its other keys are ignored)."""
        return cls(**{f.name: data[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class LeaseHeld:
    holder: str
    expires_at: str

    def __str__(self) -> str:
        return f"{self.holder}, until {self.expires_at}"


def rejoin(conn, lease: Lease) -> Lease:
    """The lease of ``lease.holder``'s run, taken again if it is gone; :class:`LeaseLost` when
    another run holds it. A new lease (new token, new time budget) is logged."""
    got = acquire(conn, lease.lock_key, lease.holder, lease.ttl_minutes, lease.max_run_minutes)
    if isinstance(got, LeaseHeld):
        raise LeaseLost(f"lease {lease.lock_key!r} is held by {got}; this run may not write")
    if got.token != lease.token:
        log.warning(
            "lease of %s (token %s) was gone, taken again: %s", lease.holder, lease.token, got
        )
    return got


def acquire(conn, lock_key: str, holder: str, ttl_minutes, max_run_minutes) -> Lease | LeaseHeld:
    """Take the lease; return :class:`Lease`, or :class:`LeaseHeld` when someone else has it.
    A holder that still has it live (the setup task re-run when one range task of a run is
    cleared while its siblings run) keeps it as it is: its token, so the siblings are not fenced
    out, and its deadline, so the run's budget does not start again."""
    params = {"lock_key": lock_key, "holder": holder, "ttl_minutes": ttl_minutes}
    params["max_run_minutes"] = max_run_minutes
    with transaction(conn) as cur:
        cur.execute(sql("common/lease_live"), params)
        row = fetch_one_dict(cur)
        if row is None:
            cur.execute(sql("common/lease_acquire"), params)
            row = fetch_one_dict(cur)
        if row is None:
            cur.execute(sql("common/lease_holder"), params)
            other = fetch_one_dict(cur) or {"holder": "?", "expires_at": "?"}
            return LeaseHeld(holder=other["holder"], expires_at=str(other["expires_at"]))
    at = {k: row[k].isoformat() for k in ("acquired_at", "run_deadline_at")}
    return Lease(**params, token=int(row["token"]), **at)


def fence(cur, lease: Lease, budget_share: float = 1.0) -> tuple[bool, bool]:
    """Inside a batch transaction: raise :class:`LeaseLost` unless the lease is still ours.

    Returns ``(past_deadline, renew_due)``: whether the run's deadline, or ``budget_share`` of
    the run's budget, has passed (no new batch may start) and whether less than half of the
    lease's TTL is left.
    """
    cur.execute(
        sql("common/lease_fence"),
        {"lock_key": lease.lock_key, "token": lease.token, "budget_share": budget_share},
    )
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
    return release_holder(conn, lease.lock_key, lease.holder)


def release_holder(conn, lock_key: str, holder: str) -> bool:
    """Release the lease if ``holder`` (a run) holds it, whatever its token."""
    with transaction(conn) as cur:
        cur.execute(sql("common/lease_release"), {"lock_key": lock_key, "holder": holder})
        released = cur.fetchone() is not None
    if released:
        log.info("released lease %s held by %s", lock_key, holder)
    else:
        log.info("lease %s is not held by %s: nothing to release", lock_key, holder)
    return released
