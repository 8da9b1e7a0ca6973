"""The real stores against the protocol model, step by step.

A hypothesis state machine drives one job through a store (SQLite and PostgreSQL
both) with random claims, renewals, completions, releases, fenced writes with and
without idempotency keys from three callers, on routes in job order and in
generation order (several writes of one generation in flight together), answers,
timeouts, writes given back,
proxy crashes and clock advances. :class:`Reference` is the protocol as model/fenceproxy.pml states
it, in a few lines of Python that share no code with the store; every answer of
the store, and what it holds after each step, must be what the reference says.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    rule,
)

from fenceproxy.errors import Refusal
from fenceproxy.fence.fencing import Admit, Busy, FencedWrite, Replay, StoredResponse, scope
from fenceproxy.leases import model as leasing
from fenceproxy.leases.model import Lease
from fenceproxy.store import Store, open_store
from fenceproxy.testing import FakeClock

from .postgres import sql

pytestmark = pytest.mark.both_stores

JOB = "job"
TTL = 2.0  # a lease's time
HOLD = 2.0  # a write's in-flight record: timeout + quarantine + slack
QUARANTINE = 1.0
KEY_TTL = 1e6  # keys outlive every run: their expiry is not what is checked here
# Two workers under one owner name (a worker restarted while its old incarnation is
# paused), and one under another.
OWNERS = ("w", "w", "v")
T = TypeVar("T")
ANSWER = StoredResponse(200, (("content-type", "text/plain"),), b"done")
# Who sends a keyed write: two credentials, and none.
CALLERS = (
    scope([("authorization", ["Bearer a"])]),
    scope([("authorization", ["Bearer b"])]),
    scope([("authorization", [])]),
)


@dataclass
class RefLease:
    owner: str
    generation: int
    until: float
    state: str  # held, released, completed


@dataclass
class RefKey:
    state: str  # in_flight, completed, unknown
    fingerprint: bytes
    generation: int
    holder: str
    scope: bytes


@dataclass
class Reference:
    """The protocol, as the model states it: one job's lease, fence, in-flight
    record and keys, on the store's clock ``now``."""

    now: float
    lease: RefLease | None = None
    fence: int | None = None
    # One per write that may be at the upstream: holder -> (state, expires, generation,
    # shared: its route orders writes by generation).
    records: dict[str, tuple[str, float, int, bool]] = field(default_factory=dict)
    keys: dict[str, RefKey] = field(default_factory=dict)

    def live_records(self) -> dict[str, tuple[str, float, int, bool]]:
        return {h: r for h, r in self.records.items() if r[1] > self.now}

    @property
    def shown(self) -> list[tuple[str, str, float] | None]:
        """What an operator may be shown: the live record that holds the job longest,
        any of them when several hold it as long (two writes of one generation
        admitted at one instant); None when none is live."""
        live = self.live_records()
        if not live:
            return [None]
        until = max(record[1] for record in live.values())
        return [(h, r[0], r[1]) for h, r in live.items() if r[1] == until]

    def lease_live(self, generation: int) -> bool:
        lease = self.lease
        return (
            lease is not None
            and lease.generation == generation
            and lease.state == "held"
            and self.now < lease.until
        )

    # -- the lease service ----------------------------------------------------

    def claim(self, owner: str) -> int | str:
        lease = self.lease
        if lease and lease.state == "completed":
            return "job-completed"
        if lease and lease.state == "held" and self.now < lease.until:
            return "lease-held"
        generation = max(lease.generation if lease else 0, self.fence or 0) + 1
        if live := self.live_records():
            # The fence goes past every generation that may still write, unless an
            # earlier ask put it there already.
            in_use = max(lease.generation if lease else 0, *(r[2] for r in live.values()))
            if self.fence is None or self.fence <= in_use:
                self.fence = generation
            return "write-in-flight"
        self.lease = RefLease(owner, generation, self.now + TTL, "held")
        self.fence = generation
        return generation

    def holder(self, owner: str, generation: int, done: str | None) -> RefLease | str:
        lease = self.lease
        if lease is None:
            return "lease-not-found"
        if generation < lease.generation:
            return "lease-superseded"
        if generation != lease.generation or owner != lease.owner:
            return "lease-mismatch"
        if done is not None and lease.state == done:
            return lease
        if lease.state == "completed":
            return "job-completed"
        if lease.state == "released":
            return "lease-released"
        if self.now >= lease.until:
            return "lease-expired"
        return lease

    def renew(self, owner: str, generation: int) -> int | str:
        lease = self.holder(owner, generation, None)
        if isinstance(lease, str):
            return lease
        lease.until = self.now + TTL
        return generation

    def end(self, owner: str, generation: int, state: str) -> int | str:
        lease = self.holder(owner, generation, state)
        if isinstance(lease, str):
            return lease
        if lease.state != state:
            lease.state, lease.until = state, min(lease.until, self.now)
        return generation

    # -- the proxy's admission and what follows ------------------------------

    def admit(self, write: FencedWrite) -> str:
        if write.key is not None and (key := self.keys.get(write.key)) is not None:
            if key.scope != write.scope:
                return "idempotency-key-other-caller"
            if key.fingerprint != write.fingerprint:
                return "idempotency-key-reused"
            if key.state == "in_flight" and key.holder in self.live_records():
                return "duplicate-in-flight"
            if key.state in ("in_flight", "unknown"):
                return "duplicate-outcome-unknown"
            return "replay"
        if self.fence is not None and write.generation < self.fence:
            return "stale-generation"
        if write.check_lease and not self.lease_live(write.generation):
            return "lease-not-live"
        # In the way: every other live record, but, for a write of a route in generation
        # order, those of such routes at its own generation.
        way = [
            state
            for holder, (state, _, generation, shared) in self.live_records().items()
            if holder != write.turn
            and not (write.shared and shared and generation == write.generation)
        ]
        if way:
            return "busy-unknown" if "unknown" in way else "busy"
        self.records[write.turn] = (
            "in_flight",
            self.now + write.hold,
            write.generation,
            write.shared,
        )
        self.fence = max(self.fence or 0, write.generation)
        if write.key is not None:
            assert write.fingerprint is not None
            self.keys[write.key] = RefKey(
                "in_flight", write.fingerprint, write.generation, write.turn, write.scope
            )
        return "admitted"

    def settle_key(self, write: FencedWrite, state: str | None) -> None:
        key = self.keys.get(write.key or "")
        if key and key.state == "in_flight" and key.holder == write.turn:
            if state is None:
                del self.keys[write.key or ""]
            else:
                key.state = state

    def end_turn(self, write: FencedWrite, unknown_for: float | None) -> None:
        record = self.records.get(write.turn)
        if record is None:
            return
        if unknown_for is None:
            del self.records[write.turn]
        else:
            _, expires, generation, shared = record
            self.records[write.turn] = (
                "unknown",
                max(expires, self.now + unknown_for),
                generation,
                shared,
            )


def outcome(result: Lease | Refusal) -> int | str:
    return result.generation if isinstance(result, Lease) else result.slug


def decision(result: Admit | Replay | Refusal | Busy) -> str:
    if isinstance(result, Admit):
        return "admitted"
    if isinstance(result, Replay):
        return "replay"
    if isinstance(result, Busy):
        return "busy-unknown" if result.unknown else "busy"
    return result.slug


class Protocol(RuleBasedStateMachine):
    """One store, driven through the protocol; :class:`Reference` beside it."""

    url = ""
    """Set per store before a run: a PostgreSQL URL, or an SQLite folder."""
    loop: asyncio.AbstractEventLoop
    """The loop every example of a run uses."""
    _runs = itertools.count()

    admitted = Bundle("admitted")

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        if self.url.startswith("postgresql"):
            self.target = self.url
            self.run(sql(self.url, "TRUNCATE fences, idempotency_keys, leases, inflight"))
        else:
            self.target = f"sqlite:///{Path(self.url) / f'run-{next(self._runs)}.db'}"
        self.store = self.open()
        self.ref = Reference(self.clock.now)
        self.generations = [0] * len(OWNERS)  # what each worker was last given
        self.epoch = 0

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(work)

    def open(self) -> Store:
        return self.run(open_store(self.target, key_ttl=KEY_TTL, clock=self.clock))

    def teardown(self) -> None:
        self.run(self.store.close())

    # -- the lease service ----------------------------------------------------

    @rule(worker=st.integers(0, len(OWNERS) - 1))
    def claim(self, worker: int) -> None:
        owner = OWNERS[worker]
        result, _ = self.run(
            self.store.change_lease(
                JOB, lambda cur, fence, now: leasing.claim(cur, fence, JOB, owner, TTL, now)
            )
        )
        assert outcome(result) == self.ref.claim(owner)
        if isinstance(result, Lease):
            self.generations[worker] = result.generation

    @rule(worker=st.integers(0, len(OWNERS) - 1))
    def lease_elsewhere(self, worker: int) -> None:
        """A worker given a newer generation by a lease service of its own (etcd, a
        scheduler): the store learns of it from its first write, so that write may
        meet older ones still in flight."""
        self.generations[worker] = max(self.generations) + 1

    @rule(worker=st.integers(0, len(OWNERS) - 1), stale=st.booleans())
    def renew(self, worker: int, stale: bool) -> None:
        owner, generation = OWNERS[worker], self.generations[worker] - stale
        result, _ = self.run(
            self.store.change_lease(
                JOB,
                lambda cur, fence, now: leasing.renew(cur, JOB, owner, generation, None, now),
            )
        )
        assert outcome(result) == self.ref.renew(owner, generation)

    @rule(worker=st.integers(0, len(OWNERS) - 1), complete=st.booleans())
    def end(self, worker: int, complete: bool) -> None:
        owner, generation = OWNERS[worker], self.generations[worker]
        decide = leasing.complete if complete else leasing.release
        result, _ = self.run(
            self.store.change_lease(
                JOB, lambda cur, fence, now: decide(cur, JOB, owner, generation, now)
            )
        )
        state = "completed" if complete else "released"
        assert outcome(result) == self.ref.end(owner, generation, state)

    # -- writes -------------------------------------------------------------

    @rule(
        target=admitted,
        worker=st.integers(0, len(OWNERS) - 1),
        older=st.integers(0, 1),
        key=st.sampled_from([None, "k1", "k2"]),
        body=st.sampled_from([b"a", b"b"]),
        checked=st.booleans(),
        caller=st.sampled_from(CALLERS),
        shared=st.booleans(),
    )
    def write(
        self,
        worker: int,
        older: int,
        key: str | None,
        body: bytes,
        checked: bool,
        caller: bytes,
        shared: bool,
    ) -> object:
        write = FencedWrite(
            "r",
            JOB,
            max(0, self.generations[worker] - older),
            key=key,
            fingerprint=None if key is None else body,
            scope=caller,
            hold=HOLD,
            check_lease=checked,
            shared=shared,
        )
        result, _ = self.run(self.store.admit(write))
        assert decision(result) == self.ref.admit(write)
        if isinstance(result, Admit):
            return multiple((self.epoch, write))
        return multiple()

    def unsettled(self, admitted: tuple[int, FencedWrite]) -> FencedWrite | None:
        """The admitted write, unless its proxy crashed since: then nothing settles it."""
        epoch, write = admitted
        return write if epoch == self.epoch else None

    @rule(admitted=consumes(admitted))
    def answered(self, admitted: tuple[int, FencedWrite]) -> None:
        if (write := self.unsettled(admitted)) is None:
            return
        # As the proxy settles a write: the key's answer and the record's end, together.
        self.run(self.store.end_turn(write, key=None if write.key is None else ANSWER))
        if write.key is not None:
            self.ref.settle_key(write, "completed")
        self.ref.end_turn(write, None)

    @rule(admitted=consumes(admitted))
    def timed_out(self, admitted: tuple[int, FencedWrite]) -> None:
        if (write := self.unsettled(admitted)) is None:
            return
        unknown = None if write.key is None else "unknown"
        self.run(self.store.end_turn(write, unknown_for=QUARANTINE, key=unknown))
        if write.key is not None:
            self.ref.settle_key(write, "unknown")
        self.ref.end_turn(write, QUARANTINE)

    @rule(admitted=consumes(admitted))
    def never_sent(self, admitted: tuple[int, FencedWrite]) -> None:
        if (write := self.unsettled(admitted)) is None:
            return
        self.run(self.store.give_back(write))
        self.ref.settle_key(write, None)
        self.ref.end_turn(write, None)

    # -- faults and time ------------------------------------------------------

    @rule()
    def crash(self) -> None:
        """The proxy dies and comes back: its writes are never settled."""
        self.run(self.store.close())
        self.store = self.open()
        self.epoch += 1

    @rule(seconds=st.sampled_from([0.5, 1.0, 2.0]))
    def tick(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.ref.now = self.clock.now

    @invariant()
    def the_store_holds_what_the_reference_does(self) -> None:
        view = self.run(self.store.inspect(JOB))
        ref = self.ref
        assert view.generation == ref.fence
        lease = view.lease
        assert (lease and (lease.owner, lease.generation, lease.lease_until, lease.state)) == (
            ref.lease and (ref.lease.owner, ref.lease.generation, ref.lease.until, ref.lease.state)
        )
        assert view.in_flight in ref.shown
        assert {k.key: (k.state, k.generation) for k in view.keys} == {
            name: (key.state, key.generation) for name, key in ref.keys.items()
        }


@pytest.mark.timeout(300)
def test_the_store_follows_the_protocol_model(store_url: str, tmp_path: Path) -> None:
    """200 runs of up to 50 steps on SQLite, 100 on PostgreSQL (each opens a pool)."""
    postgres = store_url.startswith("postgresql")
    Protocol.url = store_url if postgres else str(tmp_path)
    Protocol.loop = loop = asyncio.new_event_loop()
    machine = Protocol.TestCase
    machine.settings = settings(
        max_examples=100 if postgres else 200,
        stateful_step_count=50,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    try:
        machine().runTest()
    finally:
        for task in asyncio.all_tasks(loop):
            task.cancel()
            loop.run_until_complete(asyncio.wait([task]))
        loop.close()
