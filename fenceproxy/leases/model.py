"""The lease decisions, pure and without I/O.

Each function takes the job's record as the store holds it (or None), the store's
``now``, and returns the new record or the refusal. The store applies the result
in one transaction. ``now`` always comes from the store's clock, never a worker's.

What a store decides inside its transactions is here too: :func:`decide_write`
(the fence, the key and, on a lease-checked route, the lease), :func:`in_the_way`
(whether the job's writes in flight let an admitted write go now) and
:func:`decide_lease` (a lease change, held back while an older write may still
reach the upstream, with the fence it raises). The store reads the rows, calls them
and writes the outcome.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import NamedTuple

from ..errors import (
    JobCompleted,
    LeaseExpired,
    LeaseHeld,
    LeaseMismatch,
    LeaseNotFound,
    LeaseNotLive,
    LeaseReleased,
    LeaseSuperseded,
    Refusal,
    WriteInFlight,
)
from ..fence.fencing import GENERATION_MAX, Admit, Busy, FencedWrite, KeyRecord, Replay, decide

__all__ = [
    "InFlight",
    "InFlightSummary",
    "Lease",
    "LeaseChange",
    "LeaseDecision",
    "LeaseState",
    "after_writes",
    "check_write",
    "claim",
    "complete",
    "decide_lease",
    "decide_write",
    "in_the_way",
    "release",
    "renew",
]


class LeaseState(enum.StrEnum):
    """A lease record's state: held (live until ``lease_until``), released (the job
    may be claimed again) or completed (the job is done; no claim is granted)."""

    HELD = "held"
    RELEASED = "released"
    COMPLETED = "completed"


@dataclass(frozen=True, slots=True)
class Lease:
    """One job's lease record. ``lease_until`` is on the store's clock."""

    job_id: str
    owner: str
    generation: int
    lease_until: float
    ttl: float
    state: LeaseState

    @property
    def token(self) -> str:
        """The plain token: the generation. With signing keys, the lease API hands out
        a signed one instead (:mod:`fenceproxy.fence.tokens`); workers treat both as opaque."""
        return str(self.generation)

    def live(self, now: float) -> bool:
        return self.state is LeaseState.HELD and now < self.lease_until


def claim(
    current: Lease | None, fence: int | None, job: str, owner: str, ttl: float, now: float
) -> Lease | Refusal:
    """A new lease with a generation above every one the job has seen, its fence
    included, unless a live lease holds the job or the job is completed."""
    if current is not None:
        if current.state is LeaseState.COMPLETED:
            return JobCompleted(
                f"job {job!r} was completed by {current.owner!r} (generation "
                f"{current.generation}); it takes no more claims",
                job_id=job,
                generation=current.generation,
            )
        if current.live(now):
            left = current.lease_until - now
            return LeaseHeld(
                f"job {job!r} is held by {current.owner!r} (generation {current.generation}) "
                f"for {left:.3f}s more",
                retry_after=left,
                job_id=job,
                owner=current.owner,
                generation=current.generation,
                expires_in=left,
            )
    generation = max(current.generation if current else 0, fence or 0) + 1
    if generation > GENERATION_MAX:
        return LeaseMismatch(f"job {job!r} has no generation left to give", job_id=job)
    return Lease(job, owner, generation, now + ttl, ttl, LeaseState.HELD)


def after_writes(
    new: Lease,
    current: Lease | None,
    fence: int | None,
    in_flight: InFlightSummary,
    now: float,
) -> LeaseDecision:
    """``new``, unless it hands out a generation while the job's in-flight records say
    a write of an older one may still reach the upstream: then the claim waits for
    it, as Chubby's lock-delay does, per job. Otherwise a new holder could read the
    upstream, be told it holds the job, and see the old holder's write land after.
    (The write cannot land after the new holder's own writes: those wait for the
    same records.)

    A claim that must wait still raises the fence, at once, past every generation
    that may still write: the old lease's and those of the writes in flight. So the
    old holder's later writes are refused as stale, no new record is taken, and the
    claim waits only for the writes already out when it first asked, never for one
    admitted after (a holder past its lease that keeps writing cannot keep the job).
    A claim that asks again while the fence is already past them raises nothing, so
    the claim finally granted gets the generation after the one it raised the fence
    to."""
    claiming = current is None or new.generation != current.generation
    if not claiming:
        return LeaseDecision(new, None)
    if in_flight.until is None or in_flight.until <= now:
        return LeaseDecision(new, new.generation)
    in_use = max(current.generation if current else 0, in_flight.generation or 0)
    if fence is not None and fence > in_use:  # raised by an earlier ask: nobody writes at it
        raise_to, fenced_at = None, fence
    else:
        raise_to = fenced_at = new.generation
    left = in_flight.until - now
    refusal = WriteInFlight(
        f"job {new.job_id!r} has a write of generation {in_flight.generation} or older that "
        f"may still reach the upstream for {left:.3f}s more; claim it then (its fence is at "
        f"generation {fenced_at} meanwhile: the old holder's later writes are refused)",
        retry_after=left,
        job_id=new.job_id,
        expires_in=left,
    )
    return LeaseDecision(refusal, raise_to)


def _check_holder(
    current: Lease | None,
    job: str,
    owner: str,
    generation: int,
    now: float,
    done: LeaseState | None,
) -> Lease | Refusal:
    """The lease, if ``owner`` holds it at ``generation`` now; else the refusal that
    says why. With ``done`` set, a lease already in that state by the same holder is
    returned as is (a retried completion or release whose reply was lost)."""
    if current is None:
        return LeaseNotFound(f"no lease was ever taken on job {job!r}", job_id=job)
    if generation < current.generation:
        return LeaseSuperseded(
            f"generation {generation} of job {job!r} was superseded by generation "
            f"{current.generation} ({current.owner!r})",
            job_id=job,
            generation=generation,
            current_generation=current.generation,
        )
    if generation != current.generation or owner != current.owner:
        return LeaseMismatch(
            f"job {job!r} at generation {current.generation} is not held by {owner!r} "
            f"at generation {generation}",
            job_id=job,
            generation=generation,
            current_generation=current.generation,
        )
    if done is not None and current.state is done:
        return current
    if current.state is LeaseState.COMPLETED:
        return JobCompleted(f"job {job!r} was completed", job_id=job, generation=generation)
    if current.state is LeaseState.RELEASED:
        return LeaseReleased(
            f"the lease of job {job!r} at generation {generation} was released",
            job_id=job,
            generation=generation,
        )
    if not current.live(now):
        return LeaseExpired(
            f"the lease of job {job!r} at generation {generation} expired "
            f"{now - current.lease_until:.3f}s ago",
            job_id=job,
            generation=generation,
        )
    return current


def renew(
    current: Lease | None, job: str, owner: str, generation: int, ttl: float | None, now: float
) -> Lease | Refusal:
    """Extend a live lease to ``ttl`` (by default its own) from now, for its holder only."""
    held = _check_holder(current, job, owner, generation, now, done=None)
    if isinstance(held, Refusal):
        return held
    ttl = held.ttl if ttl is None else ttl
    return replace(held, lease_until=now + ttl, ttl=ttl)


def complete(
    current: Lease | None, job: str, owner: str, generation: int, now: float
) -> Lease | Refusal:
    """Mark the job done, for the holder of a live lease; idempotent for that holder."""
    return _end(current, job, owner, generation, now, LeaseState.COMPLETED)


def release(
    current: Lease | None, job: str, owner: str, generation: int, now: float
) -> Lease | Refusal:
    """Give the job up before the lease runs out; idempotent for that holder."""
    return _end(current, job, owner, generation, now, LeaseState.RELEASED)


def _end(
    current: Lease | None, job: str, owner: str, generation: int, now: float, state: LeaseState
) -> Lease | Refusal:
    held = _check_holder(current, job, owner, generation, now, done=state)
    if isinstance(held, Refusal) or held.state is state:
        return held
    return replace(held, state=state, lease_until=min(held.lease_until, now))


def check_write(lease: Lease | None, job: str, generation: int, now: float) -> LeaseNotLive | None:
    """None when a write of ``job`` at ``generation`` may go on a lease-checked route:
    the job's lease is at that generation and live now. Otherwise the refusal that
    says why (never taken, another generation, expired, released or completed)."""
    if lease is not None and lease.generation == generation and lease.live(now):
        return None
    if lease is None:
        why = "no lease was ever taken on it"
    elif lease.generation != generation:
        why = f"its lease is at generation {lease.generation}"
    elif lease.state is not LeaseState.HELD:
        why = f"its lease at that generation was {lease.state.value}"
    else:
        why = f"its lease at that generation expired {now - lease.lease_until:.3f}s ago"
    return LeaseNotLive(
        f"a write of job {job!r} at generation {generation} needs that lease to be live; {why}",
        job=job,
        generation=generation,
    )


LeaseChange = Callable[[Lease | None, int | None, float], Lease | Refusal]
"""A lease decision: (the job's lease, its fence, the store's now) -> new lease or refusal."""


def decide_write(
    write: FencedWrite, current: int | None, key: KeyRecord | None, lease: Lease | None, now: float
) -> Admit | Replay | Refusal:
    """:func:`~fenceproxy.fence.fencing.decide`, and for a write that would be admitted on a
    lease-checked route, the lease check: a refused write never raises the fence.
    ``lease`` is read only when ``write.check_lease``."""
    decision = decide(write, current, key)
    if write.check_lease and isinstance(decision, Admit):
        return check_write(lease, write.job, write.generation, now) or decision
    return decision


def decide_lease(
    change: LeaseChange,
    current: Lease | None,
    fence: int | None,
    in_flight: InFlightSummary,
    now: float,
) -> LeaseDecision:
    """``change`` applied to the job's lease, its fence and the store's ``now``; a
    claim waits while the job's live in-flight records say an older write may still
    reach the upstream, and raises the fence meanwhile (:func:`after_writes`)."""
    result = change(current, fence, now)
    if isinstance(result, Refusal):
        return LeaseDecision(result, None)
    return after_writes(result, current, fence, in_flight, now)


class InFlightSummary(NamedTuple):
    """What a lease change reads of a job's live in-flight records: when the last of
    them expires and the highest generation among them (both None when none is live)."""

    until: float | None
    generation: int | None


class LeaseDecision(NamedTuple):
    """A lease change's outcome, for the store to apply in one transaction: the new
    lease (written when it differs from the one read) or the refusal, and the
    generation to raise the job's fence to, if any. A granted claim raises it to its
    own; a claim that must wait for writes in flight, past every generation that may
    still write."""

    result: Lease | Refusal
    fence: int | None


@dataclass(frozen=True, slots=True)
class InFlight:
    """One write of a job that may be at the upstream: its in-flight record.

    A job holds one per admitted write until the upstream answered it, or, when its
    outcome is unknown, until its quarantine is over (``state`` ``unknown``). A
    record of a proxy that died stays until it expires: only its job waits."""

    holder: str
    """The write's turn (:attr:`FencedWrite.turn`)."""
    state: str
    """``in_flight``, or ``unknown`` once it was sent and got no answer."""
    expires_at: float
    """On the store's clock."""
    generation: int
    shared: bool
    """Its route orders writes by generation (:attr:`FencedWrite.shared`)."""


def in_the_way(write: FencedWrite, records: Iterable[InFlight], now: float) -> Busy | None:
    """Whether the job's live in-flight ``records`` hold back ``write``, which the
    fence would admit: :class:`Busy` if they do, else None and it may go.

    In job order (the default) any other write in flight holds it back: one write of
    a job at the upstream at a time. In generation order a shared write goes along
    with the shared writes of its own generation, and waits for every other: one of
    an older generation (or of a route in job order) may still land, and a newer
    generation's write must never be overtaken by it. A newer generation's record
    cannot exist here: the fence refuses the write as stale first.

    ``retry_after`` is when the last of them expires; ``unknown`` says one of them
    got no answer, so waiting before then is in vain."""
    blocking = [
        r
        for r in records
        if r.expires_at > now
        and r.holder != write.turn
        and not (write.shared and r.shared and r.generation == write.generation)
    ]
    if not blocking:
        return None
    return Busy(
        retry_after=max(r.expires_at for r in blocking) - now,
        unknown=any(r.state == "unknown" for r in blocking),
    )
