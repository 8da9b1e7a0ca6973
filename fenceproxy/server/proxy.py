"""The request path: route, decide, forward, answer.

Every request's path is read once (:mod:`fenceproxy.http.target`): made canonical to find
its route, then taken as that route's ``paths`` says (refused unless canonical,
resolved, or as sent); that one form is matched against the routes, gives the job,
goes into the idempotency fingerprint and is what the upstream receives. A request
is fenced when its route fences its method, or the method a method-override header
names.

A fenced write goes through these steps (its states and their transitions are
:class:`~fenceproxy.fence.write.Attempt`'s; steps 2 to 4 are its
:class:`~fenceproxy.server.turn.Turn`):

1. its fencing headers are parsed (each must be sent once) and its body is read in
   full (up to the route's ``max_body``), so nothing the client does later can hold
   up the job;
2. it waits for its turn among this process's writes of the job (first come,
   first served);
3. the store decides, and commits the new fence, the key's *in flight* mark and
   the job's *in-flight record*, which says that this write may be at the upstream
   until the route's ``connect_timeout``, ``timeout`` and ``quarantine`` have passed
   on the store's clock; while another write (of any proxy) holds that record, this
   one polls for up to the route's ``timeout``, then gets 503 ``job-quarantined``;
4. it is forwarded; once the upstream has answered, the record is cleared and the
   job's next write may go;
5. for a keyed write, the answer is committed under the key *before* it is sent
   back, so an answer the client got can always be replayed.

When the upstream may still be applying a write whose outcome is unknown (it timed
out, or the connection broke after sending), the record stays, marked unknown, for
the route's ``quarantine``, so no newer write can overtake it there. A proxy that
dies with writes in flight leaves their records behind: only those jobs wait, on
every proxy sharing the store, until the records expire.

Every refusal is raised as a :class:`~fenceproxy.errors.Refusal` and rendered by
:func:`~fenceproxy.http.answer.problem_answer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import Refusal, UnsupportedFraming
from ..fence.fencing import FencedWrite, fingerprint_digest
from ..fence.tokens import SigningKeys
from ..fence.write import Reading, read_write
from ..http.answer import Answer
from ..http.edge import Bodies, HeldBody
from ..http.http1 import UpstreamResponse, map_failure
from ..http.request import Request
from ..http.routes import Route, Router
from ..http.target import read_path
from ..http.upstream import TrustedProxies, UpstreamPool, replayable_headers
from ..log import decision_log
from ..ops.metrics import Metrics
from ..ops.recent import Event
from ..store import Store
from .relay import Relay, answer, check_length, relay, replayed
from .turn import JobLocks, Turn, Turns

if TYPE_CHECKING:
    from ..ops.tracing import Tracing

__all__ = ["WOULD_REFUSE", "Proxy", "ProxySettings"]

WOULD_REFUSE = frozenset(
    {
        "fencing-header-missing",
        "fencing-header-malformed",
        "idempotency-key-malformed",
        "method-override-malformed",
        "token-rejected",
        "stale-generation",
        "lease-not-live",
        "duplicate-in-flight",
        "duplicate-outcome-unknown",
        "duplicate-rejected",
        "duplicate-not-stored",
        "idempotency-key-reused",
        "idempotency-key-other-caller",
        "job-quarantined",
        "store-unavailable",
    }
)
"""The fencing decisions a report-only route forwards anyway: every refusal of a
write that enforcing would not send. Never the request's own faults (a body too
large, too slow, malformed framing) nor the upstream's (unreachable, timed out): those
are answered alike in both modes."""


@dataclass(frozen=True, slots=True)
class ProxySettings:
    """What the config says of every route's requests, beyond the routes."""

    trusted: TrustedProxies
    """Peers whose X-Forwarded-* headers are believed."""
    max_stored_response: int
    """The largest answer kept with its idempotency key, to be replayed."""
    keys: SigningKeys | None = None
    """The keys that verify signed fencing tokens."""


@dataclass(frozen=True, slots=True)
class _Outgoing:
    """A fenced write as it goes to the upstream, its body held whole."""

    write: FencedWrite
    method: str
    target: str
    fields: bytes
    """The field lines the upstream gets (:func:`~fenceproxy.http.upstream.forwarded_fields`)."""
    host: str | None
    body: HeldBody


class Proxy:
    """The handler for every proxied request."""

    def __init__(
        self,
        router: Router,
        settings: ProxySettings,
        store: Store,
        upstreams: UpstreamPool,
        *,
        bodies: Bodies,
        metrics: Metrics,
        locks: JobLocks,
        tracing: Tracing | None = None,
    ) -> None:
        """Every fenced write's outcome is counted in ``metrics``, and noted on its span
        with ``tracing``; ``locks`` queue this process's writes of each job. Made on
        the event loop the requests are served on."""
        # Kept: asyncio.timeout() looks the loop up again, a getpid() system call each time.
        self._loop = asyncio.get_running_loop()
        self._metrics = metrics
        self._tracing = tracing
        self._bodies = bodies
        self._upstreams = upstreams
        self._relay = Relay(bodies, upstreams)
        self._turns = Turns(store, locks, metrics.series.store, tracing=tracing)
        self.reconfigure(router, settings)

    def reconfigure(self, router: Router, settings: ProxySettings) -> None:
        """Take a reloaded config's routes and settings for every request from now on.
        A request already routed finishes under the route it matched; the keyed
        writes in flight stay known, whatever the config says now."""
        self._router = router
        self._relay.trusted = settings.trusted
        self._max_stored = settings.max_stored_response
        self._signing = settings.keys

    async def handle(self, request: Request, raw: str) -> Answer:
        """Forward ``request``, whose raw path (no query) is ``raw``, or raise a
        Refusal; the path is read once (:func:`read_path`), then taken as its route's
        ``paths`` says (:meth:`Router.route`)."""
        coding = request.coding
        if coding is not None and coding.strip().lower() != b"chunked":
            # Reject, never repair: the body would reach the upstream re-framed.
            raise UnsupportedFraming("the only transfer coding accepted is chunked")
        route, path_job, path = self._router.route(read_path(raw))
        query = request.query
        target = f"{path}?{query}" if query else path
        if route.fence is None:  # its fields are never read
            return await self._relay.pass_through(request, route, target)
        reading = read_write(route, request.method, request.headers, path_job, self._signing)
        if not (reading.fenced or reading.refusal is not None):
            return await self._relay.pass_through(request, route, target)
        return await self._fenced(request, route, target, reading)

    async def close(self) -> None:
        """Cut the fenced writes still in their turn and let each settle
        (:meth:`Turns.close`)."""
        await self._turns.close()

    # -- fenced -----------------------------------------------------------------

    async def _fenced(
        self, request: Request, route: Route, target: str, reading: Reading
    ) -> Answer:
        """A fenced write, counted and logged: a refusal as a refusal (unless the
        method override could not be read: nobody can tell whether it was fenced),
        an answer as what became of the write."""
        started = time.monotonic()
        try:
            response = await self._reported(request, route, target, reading)
        except Refusal as refusal:
            if reading.fenced:
                event = self._decided(route, reading, refusal.slug, refusal.status, started,
                                      refusal.extensions.get("current_generation"))  # fmt: skip
                if decision_log.isEnabledFor(logging.INFO):
                    refusal.logged = True
                    _log_decision(logging.INFO, event)
            raise
        told = response.decision or "forwarded"  # forwarded, replayed, would-<kind>
        event = self._decided(route, reading, told, response.status, started, None)
        # What a report-only route would have refused is told as a refusal is.
        level = logging.INFO if told.startswith("would-") else logging.DEBUG
        if decision_log.isEnabledFor(level):
            _log_decision(level, event)
        return response

    async def _reported(
        self, request: Request, route: Route, target: str, reading: Reading
    ) -> Answer:
        """Report mode, in one place: on a report-only route, a write the fence would
        refuse (a kind in WOULD_REFUSE) or answer from its key goes to the upstream
        as it came, unfenced, and the answer says so."""
        report = route.fence is not None and route.fence.report
        with contextlib.ExitStack() as holding:
            out: _Outgoing | None = None
            try:
                out = await self._outgoing(request, route, target, reading, holding)
                response = await self._forward_fenced(request, route, out)
                kind = "replayed" if report and response.decision == "replayed" else None
            except Refusal as refusal:
                if not (report and refusal.slug in WOULD_REFUSE):
                    raise
                kind = refusal.slug
            if kind is None:
                return response
            return await self._relay.report(request, route, target, _held(out), kind)

    async def _outgoing(
        self,
        request: Request,
        route: Route,
        target: str,
        reading: Reading,
        holding: contextlib.ExitStack,
    ) -> _Outgoing:
        """The write as it goes upstream, its head checked, then its body read whole (up
        to ``max_body``, held until ``holding`` closes): the client cannot hold up the job."""
        write = reading.write
        if write is None:
            assert reading.refusal is not None
            raise reading.refusal
        check_length(request, route)
        fields, host = self._relay.head(request, route, fenced=True)
        # Hashed as it arrives; on a route that preserves Host, the Host names the resource.
        digest = None
        if write.key is not None:
            digest = fingerprint_digest(request.method, target, reading.override, host)
        held = await self._bodies.read(request, route.max_body, spill=True, digest=digest)
        holding.callback(held.release)
        if digest is not None:
            write = dataclasses.replace(write, fingerprint=digest.digest())
        return _Outgoing(write, request.method, target, fields, host, held)

    async def _forward_fenced(self, request: Request, route: Route, out: _Outgoing) -> Answer:
        """Forward a write in its job's turn (:mod:`.turn`); answer once the turn is
        given back. A keyed write's answer, read whole up to the replay cap, is
        committed under its key before the client gets it."""
        async with self._turns.take(out.write, route) as turn:
            if turn.replay is not None:
                return replayed(turn.replay)
            request.forwarding = True
            upstream, body, whole = await self._exchange(turn, route, out)
        if whole and out.write.key is not None:
            upstream.release()
            return answer(upstream, body)
        return relay(request, upstream, prefix=body)

    async def _exchange(
        self, turn: Turn, route: Route, out: _Outgoing
    ) -> tuple[UpstreamResponse, bytes, bool]:
        """Send an admitted write and, if keyed, read the answer it keeps: the upstream's
        response, what was read of its body and whether that is all of it. Sending and
        reading are bounded as a whole, so the exchange cannot outlive its record."""
        attempt = turn.attempt
        assert attempt is not None
        sent = time.monotonic()
        attempt.send(sent)  # JobQuarantined if the proxy stalled since
        keyed, body, whole = out.write.key is not None, b"", True
        try:
            with self._metrics.in_flight.track_inprogress():
                async with asyncio.timeout_at(self._loop.time() + attempt.timeout):
                    upstream = turn.upstream = await self._upstreams.send(
                        route, out.method, out.target, out.fields, out.body.payload(),
                        host=out.host, length=out.body.size,
                    )  # fmt: skip
                    out.body.release()  # the upstream has it
                    if keyed:
                        body, whole = await upstream.read_capped(self._max_stored)
        except TimeoutError as exc:
            raise map_failure(exc) from None
        finally:
            self._metrics.series.upstream(time.monotonic() - sent)
        replayable = replayable_headers(upstream) if keyed else ()
        attempt.answered(upstream.status, replayable, body, whole=whole)
        return upstream, body, whole

    def _decided(
        self,
        route: Route,
        reading: Reading,
        outcome: str,
        status: int,
        started: float,
        current: int | None,
    ) -> Event:
        """Count a fenced write's decision, note it on its span and keep it for the
        operator page."""
        if self._tracing is not None:
            self._tracing.decided(route, reading.job, reading.generation, current,
                                  reading.key is not None, outcome)  # fmt: skip
        seconds = time.monotonic() - started
        self._metrics.decided(route.name, outcome, seconds)
        ms = round(seconds * 1000, 3)
        return self._metrics.recent.write(
            route.name, reading.job, reading.generation, current, reading.key, outcome, status, ms
        )


def _log_decision(level: int, event: Event) -> None:
    """One line for a fenced decision. Values come validated (the job, the generation,
    the key), never the token, a header or the body."""
    decision_log.log(
        level,
        "%s",
        event.outcome,
        extra={
            "fields": {
                "route": event.route,
                "job": event.job,
                "generation": event.generation,
                "current_generation": event.current_generation,
                "key": event.key,
                "decision": event.outcome,
                "status": event.status,
                "replayed": event.outcome == "replayed",
                "ms": event.ms,
            }
        },
    )


def _held(out: _Outgoing | None) -> HeldBody | None:
    return None if out is None else out.body
