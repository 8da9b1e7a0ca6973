"""What both backends read and write as rows: the shared SQL of a job's view, and
each record as its columns, both ways. SQLite and PostgreSQL take the same values;
the statements around them are each backend's own."""

from __future__ import annotations

import json
from typing import Any

from ..fence.fencing import FencedWrite, KeyRecord, KeyState, StoredResponse
from ..leases.model import InFlight, Lease, LeaseState
from .base import JobView, KeyView

__all__ = [
    "JOBS_SQL",
    "JOB_VIEW_SQL",
    "RECENT_KEYS",
    "in_flight_records",
    "job_view",
    "key_record",
    "key_row",
    "lease_record",
    "lease_row",
]

RECENT_KEYS = 20
# What a job view reads, with ``?`` for its one parameter (the job), in this order.
JOB_VIEW_SQL = (
    "SELECT generation, updated_at FROM fences WHERE job = ?",
    "SELECT job, owner, generation, lease_until, ttl, state FROM leases WHERE job = ?",
    # The job's write in flight that holds it longest, when several are (shown while live).
    "SELECT holder, state, expires_at FROM inflight WHERE job = ? ORDER BY expires_at DESC LIMIT 1",
    "SELECT route, key, state, generation, status, created_at, expires_at"
    f" FROM idempotency_keys WHERE job = ? ORDER BY created_at DESC LIMIT {RECENT_KEYS}",
)
# Job ids with a fence or a lease: parameters (prefix length, prefix, after) twice, limit.
JOBS_SQL = (
    "SELECT job FROM fences WHERE substr(job, 1, ?) = ? AND job > ?"
    " UNION SELECT job FROM leases WHERE substr(job, 1, ?) = ? AND job > ?"
    " ORDER BY job LIMIT ?"
)


def job_view(job: str, now: float, fence: Any, lease: Any, inflight: Any, keys: Any) -> JobView:
    """A :class:`JobView` from the rows of :data:`JOB_VIEW_SQL`."""
    return JobView(
        job=job,
        now=float(now),
        generation=None if fence is None else int(fence[0]),
        generation_set_at=None if fence is None else float(fence[1]),
        lease=lease_record(lease),
        in_flight=None
        if inflight is None or float(inflight[2]) <= now
        else (str(inflight[0]), str(inflight[1]), float(inflight[2])),
        keys=tuple(_key_view(row) for row in keys),
    )


def in_flight_records(found: Any) -> list[InFlight]:
    """In-flight records from rows of (holder, state, expires_at, generation, shared)."""
    return [
        InFlight(str(holder), str(state), float(expires_at), int(generation), bool(shared))
        for holder, state, expires_at, generation, shared in found
    ]


def _key_view(row: Any) -> KeyView:
    route, key, state, generation, status, created_at, expires_at = row
    return KeyView(
        str(route),
        str(key),
        str(state),
        int(generation),
        None if status is None else int(status),
        float(created_at),
        float(expires_at),
    )


def lease_record(row: Any) -> Lease | None:
    """A ``(job, owner, generation, lease_until, ttl, state)`` row as a Lease."""
    if row is None:
        return None
    job, owner, generation, lease_until, ttl, state = row
    return Lease(
        str(job), str(owner), int(generation), float(lease_until), float(ttl), LeaseState(state)
    )


def key_record(row: Any) -> KeyRecord | None:
    """A ``(state, fingerprint, status, headers, body, live, scope)`` row as a key's
    record. A key in flight whose write no longer holds its job's in-flight record
    (``live`` false: that proxy died, or the record expired) reads as unknown."""
    if row is None:
        return None
    state, fp, status, headers, body, live, scope = row
    response = None
    if state == KeyState.COMPLETED:
        pairs = tuple((str(k), str(v)) for k, v in json.loads(headers))
        response = StoredResponse(status=int(status), headers=pairs, body=body)
    elif state == KeyState.IN_FLIGHT and not live:
        state = KeyState.UNKNOWN
    return KeyRecord(
        state=KeyState(state), fingerprint=bytes(fp), response=response, scope=bytes(scope)
    )


def key_row(write: FencedWrite, now: float, ttl: float) -> tuple[Any, ...]:
    """A key going in flight, as the columns ``(route, job, key, fingerprint, scope,
    generation, holder, created_at, expires_at)``."""
    return (
        write.route,
        write.job,
        write.key,
        write.fingerprint,
        write.scope,
        write.generation,
        write.turn,
        now,
        now + ttl,
    )


def lease_row(lease: Lease, now: float) -> tuple[Any, ...]:
    """A lease as the columns ``(job, owner, generation, lease_until, ttl, state,
    updated_at)``."""
    return (
        lease.job_id,
        lease.owner,
        lease.generation,
        lease.lease_until,
        lease.ttl,
        lease.state.value,
        now,
    )
