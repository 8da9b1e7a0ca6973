"""The request path: route, decide, forward, answer.

Every request's path is read once (:mod:`fenceproxy.http.target`): made canonical to find
its route, then taken as that route's ``paths`` says (refused unless canonical,
resolved, or as sent); that one form is matched against the routes, gives the job,
goes into the idempotency fingerprint and is what the upstream receives. A request
is fenced when its route fences its method, or the method a method-override header
names.

A fenced write goes through these steps:

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
:func:`problem_response`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy, istr

from ..errors import (
    FencingHeaderMalformed,
    FencingHeaderMissing,
    JobQuarantined,
    Refusal,
    RequestHeaderMalformed,
    StoreError,
    StoreUnavailable,
    UnsupportedFraming,
    UpstreamError,
)
from ..fence.fencing import (
    SHARED_SCOPE,
    Admit,
    Busy,
    FencedWrite,
    KeyRecord,
    KeyState,
    Replay,
    StoredResponse,
    decide,
    fingerprint_digest,
    parse_job,
    parse_key,
    parse_method_override,
    scope,
    single_field,
)
from ..fence.tokens import SigningKeys, read_token
from ..http import hdrs
from ..http.edge import Bodies, HeldBody, check_body_size
from ..http.http1 import UpstreamResponse, map_failure
from ..http.routes import Fence, Route, Router
from ..http.upstream import (
    TrustedProxies,
    UpstreamPool,
    forwarded_headers,
    replayable_headers,
    response_headers,
)
from ..log import decision_log, proxy_log
from ..ops.metrics import Metrics
from ..ops.recent import Event
from ..store import Store

__all__ = ["WOULD_REFUSE", "Proxy", "ProxySettings"]

T = TypeVar("T")
# What became of an admitted keyed write: the upstream's answer, or one of these.
_Outcome = StoredResponse | Literal["unknown", "not-sent"]
# An unfenced body up to this size is read whole and sent in one piece, as nginx
# buffers request bodies; a longer or chunked one is streamed through.
_BUFFERED = 64 * 1024
_SETTLE_RETRY = 1.0
# How long close() lets the writes it cuts settle (abort, key, record) in the store.
_SETTLE_AT_CLOSE = 5.0
# An admitted write is sent only this soon after its admission was asked for: its
# in-flight record lasts the route's timeout plus quarantine plus this.
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

_TURN_SLACK = 1.0
_BUSY_POLL_FIRST = 0.002
_BUSY_POLL_MAX = 0.05
_Slot = tuple[str, str]  # (job, key): a key is its job's, whatever route it came by


@dataclass(frozen=True, slots=True)
class ProxySettings:
    """What the config says of every route's requests, beyond the routes."""

    trusted: TrustedProxies
    """Peers whose X-Forwarded-* headers are believed."""
    max_stored_response: int
    """The largest answer kept with its idempotency key, to be replayed."""
    send_timeout: float
    """How long a client may take to read the next part of a streamed answer."""
    keys: SigningKeys | None = None
    """The keys that verify signed fencing tokens."""


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
    ) -> None:
        """Every fenced write's outcome is counted in ``metrics``."""
        self._metrics = metrics
        self._bodies = bodies
        self._store = store
        self._upstreams = upstreams
        self.reconfigure(router, settings)
        # Keyed writes of this process from arrival until the store has their final
        # state: a duplicate is answered at once rather than queued behind the
        # original, and a state the store could not take yet is still honoured.
        # Only ever refuses or replays, never admits: the store holds the truth for every
        # proxy, and another proxy reading a key this one could not settle refuses it.
        self._keys: dict[_Slot, KeyRecord] = {}
        self._background: set[asyncio.Task[None]] = set()
        # The handlers of fenced writes in their job's turn, cut at close.
        self._writing: set[asyncio.Task[object]] = set()

    def reconfigure(self, router: Router, settings: ProxySettings) -> None:
        """Take a reloaded config's routes and settings for every request from now on.
        A request already routed finishes under the route it matched; the keyed
        writes in flight stay known, whatever the config says now."""
        self._router = router
        self._trusted = settings.trusted
        self._max_stored = settings.max_stored_response
        self._send_timeout = settings.send_timeout
        self._signing = settings.keys

    async def handle(self, request: web.BaseRequest, raw: str) -> web.StreamResponse:
        """Forward ``request``, whose raw path (no query) is ``raw``, or raise a
        Refusal; the path is read as its route's ``paths`` says (:meth:`Router.route`)."""
        coding = request.headers.get(hdrs.TRANSFER_ENCODING)
        if coding is not None and coding.strip().lower() != "chunked":
            # Reject, never repair: the body would reach the upstream re-framed.
            raise UnsupportedFraming("the only transfer coding accepted is chunked")
        url = request.rel_url
        route, path_job, path = self._router.route(raw)
        query = url.raw_query_string
        target = f"{path}?{query}" if query else path
        fence = route.fence
        if fence is None:
            return await self._pass_through(request, route, target)
        h = request.headers
        aliases = _underscored(h)
        try:
            override = parse_method_override(
                [
                    (str(name), value)
                    for name in hdrs.METHOD_OVERRIDES
                    for value in _values(h, name, aliases)
                ]
            )
        except Refusal as refusal:
            if not (fence.report and refusal.slug in WOULD_REFUSE):
                raise
            started = time.monotonic()
            response = await self._report(request, route, target, None, refusal.slug)
            self._answered(route, _Seen(), response, started)
            return response
        if fence.fences(request.method) or (override is not None and fence.fences(override)):
            seen = _Seen()
            started = time.monotonic()
            try:
                response = await self._fenced(
                    request, route, target, path_job, override, aliases, seen
                )
            except Refusal as refusal:
                event = self._decided(route, seen, refusal.slug, refusal.status, started,
                                      refusal.extensions.get("current_generation"))  # fmt: skip
                if decision_log.isEnabledFor(logging.INFO):
                    refusal.logged = True
                    _log_decision(logging.INFO, event)
                raise
            self._answered(route, seen, response, started)
            return response
        return await self._pass_through(request, route, target)

    def _answered(
        self, route: Route, seen: _Seen, response: web.StreamResponse, started: float
    ) -> None:
        """Count and log a fenced write that was answered (not refused)."""
        decision = _decision(response)
        event = self._decided(route, seen, decision, response.status, started, None)
        # What a report-only route would have refused is told as a refusal is.
        level = logging.INFO if decision.startswith("would-") else logging.DEBUG
        if decision_log.isEnabledFor(level):
            _log_decision(level, event)

    def _decided(
        self,
        route: Route,
        seen: _Seen,
        outcome: str,
        status: int,
        started: float,
        current: int | None,
    ) -> Event:
        """Count a fenced write's decision and keep it for the operator page."""
        self._metrics.decided(route.name, outcome)
        ms = round((time.monotonic() - started) * 1000, 3)
        return self._metrics.recent.write(
            route.name, seen.job, seen.generation, current, seen.key, outcome, status, ms
        )

    async def close(self) -> None:
        """Cut the fenced writes still in their turn (shutdown's drain time is over)
        and let each settle while the store is still open: its upstream connection
        aborted, its key and record marked unknown, held for the route's quarantine
        on every proxy. Then stop retrying key settlements: a key in flight whose
        in-flight record is gone reads as unknown to every proxy. A write that could
        not settle in time leaves its record to expire."""
        writing = [task for task in self._writing if not task.done()]
        for task in writing:
            task.cancel()
        if writing:
            await asyncio.wait(writing, timeout=_SETTLE_AT_CLOSE)
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    # -- unfenced ---------------------------------------------------------------

    async def _pass_through(
        self, request: web.BaseRequest, route: Route, target: str, mark: str | None = None
    ) -> web.StreamResponse:
        """Forward as it came; ``mark``, when given, is the answer's Fencing-Decision."""
        _check_length(request, route)
        length = request.content_length
        if length is not None and length <= _BUFFERED:
            held = await self._bodies.read(request, route.max_body)  # one write upstream
            try:
                return await self._send(request, route, target, length, held, mark)
            finally:
                held.release()
        stream = self._bodies.stream(request, route.max_body) if request.body_exists else None
        return await self._send(request, route, target, length, stream, mark)

    async def _send(
        self,
        request: web.BaseRequest,
        route: Route,
        target: str,
        length: int | None,
        body: HeldBody | AsyncIterator[bytes] | None,
        mark: str | None = None,
    ) -> web.StreamResponse:
        fence = route.fence
        keep = fence.fields if fence is not None and mark is not None else frozenset()
        headers = forwarded_headers(request, self._trusted, length, keep=keep)
        host = _host(request, route)
        payload = body.payload() if isinstance(body, HeldBody) else body
        upstream = await self._upstreams.send(
            route, request.method, target, headers, payload, host=host
        )
        if isinstance(body, HeldBody):
            body.release()  # the upstream has it
        try:
            return await _relay(request, upstream, self._send_timeout, mark=mark)
        finally:
            upstream.release()

    async def _report(
        self,
        request: web.BaseRequest,
        route: Route,
        target: str,
        held: HeldBody | None,
        kind: str,
    ) -> web.StreamResponse:
        """Report only: a write enforcing would refuse (``kind``, its problem kind) or
        answer from its key (``replayed``) goes to the upstream as it came, unfenced,
        and the answer says so. Nothing of it is recorded, as enforcing would record
        nothing of it."""
        mark = "would-replay" if kind == "replayed" else f"would-refuse; kind={kind}"
        if held is None:  # refused on its headers: the body is still unread
            response = await self._pass_through(request, route, target, mark)
        else:
            response = await self._send(request, route, target, held.size, held, mark)
        response[_DECISION] = "would-replay" if kind == "replayed" else f"would-{kind}"
        return response

    # -- fenced -----------------------------------------------------------------

    async def _fenced(
        self,
        request: web.BaseRequest,
        route: Route,
        target: str,
        path_job: str | None,
        override: str | None,
        aliases: list[tuple[str, str]],
        seen: _Seen,
    ) -> web.StreamResponse:
        fence = route.fence
        assert fence is not None
        try:
            write, headers = self._fenced_write(
                request, route, fence, target, path_job, override, aliases, seen
            )
        except Refusal as refusal:
            if fence.report and refusal.slug in WOULD_REFUSE:
                return await self._report(request, route, target, None, refusal.slug)
            raise
        # Checked before admission, so a bad Host holds nothing.
        host = _host(request, route)
        # Hashed as it arrives: a body kept on disk is not read twice. On a route that
        # preserves Host, the Host names the resource too (a virtual-hosted bucket).
        digest = (
            None
            if write.key is None
            else fingerprint_digest(request.method, target, override, host)
        )
        held = await self._bodies.read(request, route.max_body, spill=True, digest=digest)
        try:
            if digest is not None:
                write = dataclasses.replace(write, fingerprint=digest.digest())
            if held.file is not None:  # sent from its file, framed as a buffered body is
                headers[istr("Content-Length")] = str(held.size)
            task = asyncio.current_task()
            assert task is not None
            self._writing.add(task)  # cut by close(), should it outlast shutdown
            try:
                if write.key is None:
                    response = await self._forward_fenced(
                        request, route, target, write, headers, held, host
                    )
                else:
                    response = await self._keyed(request, route, target, write, headers, held, host)
            except Refusal as refusal:
                if fence.report and refusal.slug in WOULD_REFUSE:
                    return await self._report(request, route, target, held, refusal.slug)
                raise
            finally:
                self._writing.discard(task)
            if fence.report and _decision(response) == "replayed":
                return await self._report(request, route, target, held, "replayed")
            return response
        finally:
            held.release()

    def _fenced_write(
        self,
        request: web.BaseRequest,
        route: Route,
        fence: Fence,
        target: str,
        path_job: str | None,
        override: str | None,
        aliases: list[tuple[str, str]],
        seen: _Seen,
    ) -> tuple[FencedWrite, CIMultiDict[str]]:
        """The write its headers describe (its fingerprint still to come from the
        body), and the headers it goes on with; a refusal raised."""
        h = request.headers
        header_job, raw_token, raw_key = (
            single_field(_values(h, name, aliases), str(name))
            for name in (fence.job_header, fence.token_header, fence.key_header)
        )
        if fence.job_in_path:
            raw_job, job_source = path_job, "path"
        else:
            raw_job, job_source = header_job, str(fence.job_header)
        if raw_job is None or raw_token is None:
            missing = [
                name
                for name, value in ((job_source, raw_job), (str(fence.token_header), raw_token))
                if value is None
            ]
            raise FencingHeaderMissing(
                f"a fenced {request.method} needs the header(s) {', '.join(missing)}",
                missing=missing,
            )
        job = seen.job = parse_job(raw_job, job_source)
        if fence.job_in_path and header_job is not None and header_job != job:
            raise FencingHeaderMalformed(
                f"{fence.job_header} names another job than the path does",
                header=str(fence.job_header),
            )
        generation = seen.generation = read_token(
            raw_token, str(fence.token_header), job, self._signing, signed_only=fence.signed_only
        )
        key = seen.key = None if raw_key is None else parse_key(raw_key, str(fence.key_header))
        _check_length(request, route)
        headers = forwarded_headers(request, self._trusted, None, keep=fence.fields)
        write = FencedWrite(
            route.name,
            job,
            generation,
            key=key,
            # Whose the key is: a digest of the caller's credentials, never them.
            scope=SHARED_SCOPE
            if key is None
            else scope([(str(n), _values(h, n, aliases)) for n in fence.scope_headers]),
            replay=fence.replay,
            hold=_in_flight_for(route) + route.quarantine + _TURN_SLACK,
            check_lease=fence.check_lease,
        )
        return write, headers

    async def _keyed(
        self,
        request: web.BaseRequest,
        route: Route,
        target: str,
        write: FencedWrite,
        headers: CIMultiDict[str],
        body: HeldBody,
        host: str | None,
    ) -> web.StreamResponse:
        """A keyed write: a duplicate of one this process is still settling is refused
        or replayed at once; otherwise it goes on, marked in flight here meanwhile."""
        assert write.key is not None
        slot = (write.job, write.key)
        if (record := self._keys.get(slot)) is not None:
            decision = decide(write, None, record)
            if isinstance(decision, Refusal):
                raise decision
            assert isinstance(decision, Replay)
            return _replay(decision.response)
        assert write.fingerprint is not None
        self._keys[slot] = KeyRecord(KeyState.IN_FLIGHT, write.fingerprint, scope=write.scope)
        try:
            return await self._forward_fenced(request, route, target, write, headers, body, host)
        finally:
            record = self._keys.get(slot)
            if record is not None and record.state is KeyState.IN_FLIGHT:
                del self._keys[slot]  # settled in the store, or never reserved there

    async def _forward_fenced(
        self,
        request: web.BaseRequest,
        route: Route,
        target: str,
        write: FencedWrite,
        headers: CIMultiDict[str],
        body: HeldBody,
        host: str | None,
    ) -> web.StreamResponse:
        """Forward an admitted write in its job's turn, with ``host`` as its Host (None:
        the upstream's own); settle its key, then give the turn back, so no other
        write ever reads the key as orphaned."""
        keyed = write.key is not None
        # The upstream's answer to a keyed write, read whole up to the replay cap.
        answer, whole = b"", True
        deadline = time.monotonic() + route.timeout
        lock = self._store.job_lock(write.job)
        if self._store.locks.users(write.job):  # queue behind this process's writes of it
            try:
                async with asyncio.timeout(route.timeout):
                    await lock.__aenter__()
            except TimeoutError:
                raise _waited_too_long(write, retry_after=1.0) from None
        else:
            await lock.__aenter__()  # free: taken at once
        upstream: UpstreamResponse | None = None
        try:
            decision, recorded_at = await self._admit(write, route, deadline)
            if isinstance(decision, Replay):
                return _replay(decision.response)
            # What the key becomes, and whether the write may be at the upstream
            # unanswered, if this ends here.
            outcome: _Outcome = "not-sent"
            in_doubt = False
            try:
                if time.monotonic() - recorded_at > _TURN_SLACK:
                    # Stalled since the record was taken: sent now, the write could
                    # still be at the upstream after the record expires.
                    raise JobQuarantined(
                        "the proxy stalled after recording this write, which was not "
                        "sent; retry it",
                        retry_after=1.0,
                        job=write.job,
                    )
                outcome, in_doubt = "unknown", True  # from here on it may reach the upstream
                try:
                    # Sending, and for a keyed write reading the answer it keeps, are
                    # bounded as a whole, so the exchange cannot outlive its record.
                    with self._metrics.in_flight.track_inprogress():
                        async with asyncio.timeout(_in_flight_for(route)):
                            upstream = await self._upstreams.send(
                                route,
                                request.method,
                                target,
                                headers,
                                body.payload(),
                                host=host,
                            )
                            body.release()  # the upstream has it
                            if keyed:
                                answer, whole = await upstream.read_capped(self._max_stored)
                except TimeoutError as exc:
                    raise map_failure(exc) from None
                except UpstreamError as exc:
                    if not exc.sent:
                        outcome, in_doubt = "not-sent", False
                    raise
                in_doubt = False  # answered
                if keyed:
                    outcome = StoredResponse(
                        upstream.status, replayable_headers(upstream), answer if whole else None
                    )
            finally:
                # The upstream has answered, or the write never left, or its outcome
                # is unknown (a cancellation mid-exchange included: it may land). An
                # exchange cut short is aborted, and its socket gone, before anything
                # else: no more of it reaches the upstream once the turn is given
                # back. The key settles next; a cancellation meanwhile is seen once
                # it has, and the turn is still given back.
                try:
                    if in_doubt and upstream is not None:
                        await upstream.cut()
                finally:
                    try:
                        if keyed:
                            await self._settle(write, outcome)
                    finally:
                        await self._end_turn(write, route, unknown=in_doubt)
        except BaseException:
            if upstream is not None:
                upstream.release()
            raise
        finally:
            await lock.__aexit__(None, None, None)
        try:
            if whole and keyed:
                return _answer(upstream, answer)
            return await _relay(request, upstream, self._send_timeout, prefix=answer)
        finally:
            upstream.release()

    async def _admit(
        self, write: FencedWrite, route: Route, deadline: float
    ) -> tuple[Admit | Replay, float]:
        """The store's decision, committed, and the monotonic instant at or before which
        its in-flight record was dated. While another write holds the job's record,
        ask again until ``deadline``; then, or at once when that write's outcome is
        unknown, refuse with JobQuarantined."""
        delay = _BUSY_POLL_FIRST
        while True:
            decision, recorded_at = await self._store_admit(write, route)
            if not isinstance(decision, Busy):
                return decision, recorded_at
            if decision.unknown:
                raise JobQuarantined(
                    "an earlier write of this job got no answer and may still be applied by "
                    "the upstream; its later writes are refused until then so none can "
                    "overtake it",
                    retry_after=decision.retry_after,
                    job=write.job,
                )
            if time.monotonic() + delay > deadline:
                raise _waited_too_long(write, retry_after=decision.retry_after)
            await asyncio.sleep(delay)
            delay = min(delay * 2, _BUSY_POLL_MAX)

    async def _store_admit(
        self, write: FencedWrite, route: Route
    ) -> tuple[Admit | Replay | Busy, float]:
        """One admission; a refusal is raised. If the request is cancelled meanwhile,
        the store gives back what it took: nothing was sent."""
        try:
            decision, recorded_at = await self._store.admit(write)
        except StoreError as exc:
            proxy_log.error("store failed, refusing the write: %s", exc)
            # The store may have committed what it could not confirm (a lost reply):
            # give back whatever this write took, so neither its job nor its key waits
            # out the record. Nothing was sent.
            self._retry_later(lambda: self._store.give_back(write), first=0.0)
            raise StoreUnavailable(
                "the fencing store could not record this write; nothing was forwarded"
            ) from exc
        if isinstance(decision, Refusal):
            raise decision
        return decision, recorded_at

    async def _end_turn(self, write: FencedWrite, route: Route, *, unknown: bool) -> None:
        """Give the job's in-flight record back, or keep it for the route's quarantine
        when the write's outcome is unknown. Survives cancellation. If the store fails,
        the record stays (the job waits, nothing worse) and clearing it is retried."""
        if unknown and route.quarantine > 0:
            proxy_log.warning(
                "job %r held for %.1fs: a write's outcome is unknown", write.job, route.quarantine
            )
        unknown_for = route.quarantine if unknown else None
        try:
            await self._store.end_turn(write, unknown_for=unknown_for)
        except StoreError as exc:
            # Until it is cleared, the record holds the job: retried in the background.
            proxy_log.error("could not clear job %r's in-flight record: %s", write.job, exc)
            self._retry_later(lambda: self._store.end_turn(write, unknown_for=unknown_for))

    async def _settle(self, write: FencedWrite, outcome: _Outcome) -> None:
        """Record what became of a keyed write: its answer, unknown, or not sent
        (the key is released). Survives cancellation; if the store fails, the
        state is kept in memory (so retries are answered by it) and retried."""
        assert write.key is not None
        assert write.fingerprint is not None
        slot = (write.job, write.key)
        try:
            await self._store_settlement(write, outcome)
        except StoreError as exc:
            proxy_log.error("could not record key %r, retrying: %s", write.key, exc)
            self._keys[slot] = _record(write, outcome)
            self._retry_later(
                lambda: self._store_settlement(write, outcome),
                lambda: self._keys.pop(slot, None),
            )
        else:
            self._keys.pop(slot, None)

    def _retry_later(
        self,
        attempt: Callable[[], Awaitable[None]],
        then: Callable[[], object] = lambda: None,
        *,
        first: float = _SETTLE_RETRY,
    ) -> None:
        """Retry a store write in the background, after ``first`` seconds and then
        every second, until it succeeds."""

        async def retry() -> None:
            delay = first
            while True:
                await asyncio.sleep(delay)
                delay = _SETTLE_RETRY
                try:
                    await attempt()
                except StoreError:
                    continue
                then()
                return

        task = asyncio.create_task(retry())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _store_settlement(self, write: FencedWrite, outcome: _Outcome) -> Awaitable[None]:
        if isinstance(outcome, StoredResponse):
            return self._store.complete_key(write, outcome)
        if outcome == "unknown":
            return self._store.mark_unknown(write)
        return self._store.forget_key(write)


class _Seen:
    """What a fenced write's headers said, as far as they were read: for its log line."""

    __slots__ = ("generation", "job", "key")

    def __init__(self) -> None:
        self.job: str | None = None
        self.generation: int | None = None
        self.key: str | None = None


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


_DECISION = web.ResponseKey("fenceproxy.decision", str)
"""Where a fenced write's answer carries what became of it, never in its headers,
which the upstream writes too."""


def _decision(response: web.StreamResponse) -> str:
    """What became of a fenced write that was answered: ``forwarded``, ``replayed``,
    or on a report-only route ``would-replay`` or ``would-<kind>`` of the refusal."""
    decision: str = response.get(_DECISION, "forwarded")
    return decision


def _in_flight_for(route: Route) -> float:
    """The longest a fenced write may take from its send to the upstream's answer:
    connecting, sending the body, waiting. The job's in-flight record covers it."""
    return route.connect_timeout + route.timeout


def _underscored(headers: CIMultiDictProxy[str]) -> list[tuple[str, str]]:
    """The fields whose names hold ``_``, named with ``-`` instead, lower-case. CGI and
    WSGI servers read ``Fencing_Token`` and ``Fencing-Token`` as one variable, so for
    the fencing and method-override fields they count as the field they spell."""
    return [(n.replace("_", "-").lower(), v) for n, v in headers.items() if "_" in n]


def _values(
    headers: CIMultiDictProxy[str], name: istr, aliases: list[tuple[str, str]]
) -> list[str]:
    """Every value of the field ``name``, in whichever spelling it came."""
    values = headers.getall(name, [])
    if aliases:
        lower = name.lower()
        values = [*values, *(v for n, v in aliases if n == lower)]
    return values


def _record(write: FencedWrite, outcome: _Outcome) -> KeyRecord:
    """The in-memory stand-in for a settlement the store has not taken yet, its
    caller's only. A key not sent but still reserved in the store reads as unknown
    until then: never let a duplicate through on a guess."""
    assert write.fingerprint is not None
    if isinstance(outcome, StoredResponse):
        return KeyRecord(KeyState.COMPLETED, write.fingerprint, outcome, write.scope)
    return KeyRecord(KeyState.UNKNOWN, write.fingerprint, scope=write.scope)


def _check_length(request: web.BaseRequest, route: Route) -> None:
    length = request.content_length
    if length is not None:
        check_body_size(length, route.max_body)


def _waited_too_long(write: FencedWrite, *, retry_after: float) -> JobQuarantined:
    return JobQuarantined(
        "another write of this job is in flight at the upstream (sent by this or another "
        "proxy, or by one that stopped); its later writes wait for it, and this one "
        "waited as long as the route's timeout",
        retry_after=retry_after,
        job=write.job,
    )


# Answers whose framing says more than their (empty) body: relayed as they came.
_NO_BODY = frozenset({204, 304})


def _answer(upstream: UpstreamResponse, body: bytes) -> web.Response:
    headers = response_headers(upstream)
    headers.popall("Content-Length", None)
    return web.Response(status=upstream.status, reason=upstream.reason, headers=headers, body=body)


def _replay(stored: StoredResponse) -> web.Response:
    assert stored.body is not None
    headers: CIMultiDict[str] = CIMultiDict(stored.headers)
    headers[hdrs.IDEMPOTENT_REPLAYED] = "true"
    response = web.Response(status=stored.status, headers=headers, body=stored.body)
    response[_DECISION] = "replayed"
    return response


async def _relay(
    request: web.BaseRequest,
    upstream: UpstreamResponse,
    send_timeout: float,
    prefix: bytes = b"",
    mark: str | None = None,
) -> web.StreamResponse:
    """Stream the upstream's answer (after ``prefix``, already read from it) to the
    client. If the upstream breaks off mid-answer, or the client takes nothing for
    ``send_timeout``, the client's connection is closed, so the client never takes a
    cut answer for a whole one and a client that does not read holds nothing. An
    answer already in whole (the common small one) goes out in one piece."""
    if request.method != "HEAD" and upstream.status not in _NO_BODY:
        whole = upstream.received_whole()
        if whole is not None:
            answer = _answer(upstream, prefix + whole)
            if mark is not None:
                answer.headers[hdrs.FENCING_DECISION] = mark
            return answer
    response = web.StreamResponse(
        status=upstream.status, reason=upstream.reason, headers=response_headers(upstream)
    )
    if mark is not None:
        response.headers[hdrs.FENCING_DECISION] = mark
    try:
        await response.prepare(request)
        if prefix:
            await response.write(prefix)
        async for chunk in upstream.chunks():
            async with asyncio.timeout(send_timeout):
                await response.write(chunk)
        await response.write_eof()
    except UpstreamError as exc:
        proxy_log.warning("upstream answer cut short: %s", exc.detail)
        if request.transport is not None:
            request.transport.close()
    except TimeoutError:
        proxy_log.info("the client took no part of the answer for %gs: closed", send_timeout)
        if request.transport is not None:
            request.transport.close()
    except ConnectionError:
        pass  # the client went away
    return response


def _host(request: web.BaseRequest, route: Route) -> str | None:
    """The ``Host`` the upstream gets: the client's on a ``host: preserve`` route, if
    it sent one (an HTTP/1.0 request may not); None for the upstream's authority."""
    if not route.preserve_host:
        return None
    if not request.raw_path.startswith("/"):
        # An absolute-form target names its own authority, which wins over Host
        # (RFC 9112 §3.2.2): which of the two a signature covers is the client's.
        raise RequestHeaderMalformed(
            "a route that forwards the client's Host takes origin-form targets only "
            "(/path, not http://host/path)",
            header="Host",
        )
    host = request.headers.get("Host")
    if host is not None and not _AUTHORITY.fullmatch(host):
        # Sent on as it came, it must be an authority (RFC 3986 §3.2): anything else
        # would reach the upstream re-encoded, or as a second header line.
        raise RequestHeaderMalformed(
            "the Host header is not a host[:port] and cannot be forwarded unchanged",
            header="Host",
        )
    return host


# An authority as RFC 3986 spells it: a reg-name, an IPv4 or a bracketed IPv6
# literal, and an optional port; ASCII only.
_AUTHORITY = re.compile(
    r"(?:[A-Za-z0-9\-._~!$&'()*+,;=%]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]*)?", re.ASCII
)
