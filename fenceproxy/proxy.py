"""The request path: route, decide, forward, answer.

For a fenced write: parse the fencing headers, take the job's lock (writes of one
job go one at a time, first come first served), let the store decide and commit
the fence, forward, release the lock once the upstream has answered, stream the
answer back and record it under the idempotency key. Every refusal is raised as a
:class:`~fenceproxy.errors.Refusal` and rendered by :func:`problem_middleware`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from . import hdrs
from .errors import (
    BodyTooLarge,
    FencingHeaderMissing,
    NoRoute,
    Refusal,
    StoreError,
    StoreUnavailable,
    UnsupportedFraming,
    UpstreamError,
)
from .fencing import (
    Admit,
    FencedWrite,
    KeyRecord,
    KeyState,
    Replay,
    StoredResponse,
    decide,
    fingerprint,
    parse_generation,
    parse_job,
    parse_key,
)
from .log import proxy_log
from .routes import Route, Router
from .store import Store
from .upstream import (
    TrustedProxies,
    UpstreamPool,
    forwarded_headers,
    replayable_headers,
    response_headers,
)

__all__ = ["PROBLEM_JSON", "Proxy", "problem_middleware"]

PROBLEM_JSON = "application/problem+json"
_CHUNK = 64 * 1024
_InFlightKey = tuple[str, str, str]


@web.middleware
async def problem_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Render refusals as RFC 9457 problem+json; log each once."""
    try:
        return await handler(request)
    except Refusal as refusal:
        proxy_log.info(
            "refused %s %s: %s (%d) %s",
            request.method,
            request.rel_url.raw_path,
            refusal.slug,
            refusal.status,
            refusal.detail,
        )
        return problem_response(refusal)


def problem_response(refusal: Refusal) -> web.Response:
    return web.json_response(refusal.problem(), status=refusal.status, content_type=PROBLEM_JSON)


class Proxy:
    """The handler for every proxied request."""

    def __init__(
        self,
        router: Router,
        store: Store,
        upstreams: UpstreamPool,
        *,
        trusted: TrustedProxies,
        max_stored_response: int,
    ) -> None:
        self._router = router
        self._store = store
        self._upstreams = upstreams
        self._trusted = trusted
        self._max_stored = max_stored_response
        # Keyed writes of this process between arrival and settling: a duplicate is
        # answered at once instead of queueing behind the original.
        self._in_flight: dict[_InFlightKey, bytes] = {}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        coding = request.headers.get(hdrs.TRANSFER_ENCODING)
        if coding is not None and coding.strip().lower() != "chunked":
            # Reject, never repair: the body would reach the upstream re-framed.
            raise UnsupportedFraming("the only transfer coding accepted is chunked")
        raw_path = request.rel_url.raw_path
        matched = self._router.match(raw_path)
        if matched is None:
            raise NoRoute(f"no route is configured for {raw_path!r}")
        route, path_job = matched
        if route.fence is None or request.method not in route.fence.methods:
            return await self._pass_through(request, route)
        return await self._fenced(request, route, path_job)

    # -- unfenced ---------------------------------------------------------------

    async def _pass_through(self, request: web.Request, route: Route) -> web.StreamResponse:
        _check_length(request, route)
        upstream = await self._send(request, route, None)
        try:
            return (await _relay(request, upstream, capture=None)).response
        finally:
            upstream.release()

    async def _send(
        self, request: web.Request, route: Route, body: bytes | None
    ) -> aiohttp.ClientResponse:
        """Forward the request with ``body``, or with the client's body streamed
        under the route's limit when ``body`` is None."""
        stream = None
        if body is None and request.body_exists:
            stream = _LimitedBody(request, route.max_body)
        headers = forwarded_headers(
            request, self._trusted, request.content_length if body is None else None
        )
        try:
            return await self._upstreams.send(
                route,
                request.method,
                request.rel_url.raw_path_qs,
                headers,
                body if body is not None else stream,
            )
        except UpstreamError as exc:
            if stream is not None and stream.too_large:
                raise BodyTooLarge(_too_large(route), max_body=route.max_body) from exc
            raise

    # -- fenced -----------------------------------------------------------------

    async def _fenced(
        self, request: web.Request, route: Route, path_job: str | None
    ) -> web.StreamResponse:
        fence = route.fence
        assert fence is not None
        h = request.headers
        if path_job is None:
            assert fence.job_header is not None
            raw_job = h.get(fence.job_header)
            job_source = str(fence.job_header)
        else:
            raw_job, job_source = path_job, "path"
        raw_token = h.get(fence.token_header)
        missing = [
            name
            for name, value in ((job_source, raw_job), (str(fence.token_header), raw_token))
            if value is None
        ]
        if missing:
            raise FencingHeaderMissing(
                f"a fenced {request.method} needs the header(s) {', '.join(missing)}",
                missing=missing,
            )
        assert raw_job is not None
        assert raw_token is not None
        job = parse_job(raw_job, job_source)
        generation = parse_generation(raw_token, str(fence.token_header))
        raw_key = h.get(fence.key_header)
        _check_length(request, route)

        if raw_key is None:
            write = FencedWrite(route.name, job, generation)
            return await self._forward_fenced(request, route, write, None)

        key = parse_key(raw_key, str(fence.key_header))
        body = await _read_limited(request, route)
        write = FencedWrite(
            route.name,
            job,
            generation,
            key=key,
            fingerprint=fingerprint(request.method, request.rel_url.raw_path_qs, body),
            replay=fence.replay,
        )
        slot = (route.name, job, key)
        if (held := self._in_flight.get(slot)) is not None:
            decision = decide(write, None, KeyRecord(KeyState.IN_FLIGHT, held))
            assert isinstance(decision, Refusal)
            raise decision
        assert write.fingerprint is not None
        self._in_flight[slot] = write.fingerprint
        try:
            return await self._forward_fenced(request, route, write, body)
        finally:
            del self._in_flight[slot]

    async def _forward_fenced(
        self, request: web.Request, route: Route, write: FencedWrite, body: bytes | None
    ) -> web.StreamResponse:
        keyed = write.key is not None
        async with self._store.job_lock(write.job):
            decision = await self._admit(write)
            if isinstance(decision, Replay):
                return _replay(decision.response)
            try:
                upstream = await self._send(request, route, body)
            except UpstreamError as exc:
                if keyed:
                    await self._settle_failed(write, sent=exc.sent)
                raise
            except BaseException:
                if keyed:
                    await self._settle_failed(write, sent=True)
                raise
        # The upstream has answered: the next write of this job may go now.
        try:
            relayed = await _relay(request, upstream, self._max_stored if keyed else None)
        except BaseException:
            if keyed:
                await self._settle_failed(write, sent=True)
            raise
        finally:
            upstream.release()
        if keyed:
            if relayed.complete:
                stored = StoredResponse(upstream.status, replayable_headers(upstream), relayed.body)
                try:
                    await _shielded(self._store.complete_key(write, stored))
                except StoreError as exc:
                    proxy_log.error("could not record the answer for key %r: %s", write.key, exc)
            else:
                await self._settle_failed(write, sent=True)
        return relayed.response

    async def _admit(self, write: FencedWrite) -> Admit | Replay:
        try:
            decision = await self._store.admit(write)
        except StoreError as exc:
            proxy_log.error("store failed, refusing the write: %s", exc)
            raise StoreUnavailable(
                "the fencing store could not record this write; nothing was forwarded"
            ) from exc
        if isinstance(decision, Refusal):
            raise decision
        return decision

    async def _settle_failed(self, write: FencedWrite, *, sent: bool) -> None:
        """A keyed write that got no full answer: forget its key if it never left,
        else keep it as outcome unknown."""
        settle = self._store.mark_unknown(write) if sent else self._store.forget_key(write)
        try:
            await _shielded(settle)
        except StoreError as exc:
            proxy_log.error("could not settle idempotency key %r: %s", write.key, exc)


async def _shielded(work: Awaitable[None]) -> None:
    """Finish a store write even if the request is being cancelled."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await task
        raise


def _too_large(route: Route) -> str:
    return f"the body is larger than this route's limit of {route.max_body} bytes"


def _check_length(request: web.Request, route: Route) -> None:
    length = request.content_length
    if length is not None and length > route.max_body:
        raise BodyTooLarge(_too_large(route), max_body=route.max_body)


async def _read_limited(request: web.Request, route: Route) -> bytes:
    body = bytearray()
    async for chunk in request.content.iter_chunked(_CHUNK):
        body += chunk
        if len(body) > route.max_body:
            raise BodyTooLarge(_too_large(route), max_body=route.max_body)
    return bytes(body)


class _LimitedBody:
    """The client's body as a stream that stops the upload above ``limit`` bytes,
    so an over-long body never reaches the upstream as a complete request."""

    __slots__ = ("_limit", "_request", "too_large")

    def __init__(self, request: web.Request, limit: int) -> None:
        self._request = request
        self._limit = limit
        self.too_large = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        seen = 0
        async for chunk in self._request.content.iter_chunked(_CHUNK):
            seen += len(chunk)
            if seen > self._limit:
                self.too_large = True
                raise BodyTooLarge(f"the body is larger than {self._limit} bytes")
            yield chunk


def _replay(stored: StoredResponse) -> web.Response:
    assert stored.body is not None
    headers: CIMultiDict[str] = CIMultiDict(stored.headers)
    headers[hdrs.IDEMPOTENT_REPLAYED] = "true"
    return web.Response(status=stored.status, headers=headers, body=stored.body)


@dataclass(slots=True)
class _Relayed:
    response: web.StreamResponse
    complete: bool
    """The whole answer was read from the upstream."""
    body: bytes | None
    """The answer's body, when captured and not longer than the cap."""


async def _relay(
    request: web.Request, upstream: aiohttp.ClientResponse, capture: int | None
) -> _Relayed:
    """Stream the upstream's answer to the client, keeping a copy of up to
    ``capture`` bytes. A client that goes away does not stop the read, so a keyed
    write still learns its outcome; an upstream that breaks off mid-answer gets the
    client's connection closed, so the client never takes a cut answer for whole."""
    response = web.StreamResponse(
        status=upstream.status, reason=upstream.reason, headers=response_headers(upstream)
    )
    copy: bytearray | None = bytearray() if capture is not None else None
    client_gone = False
    try:
        await response.prepare(request)
    except ConnectionError:
        client_gone = True
    try:
        async for chunk in upstream.content.iter_any():
            if copy is not None:
                copy += chunk
                if capture is not None and len(copy) > capture:
                    copy = None
            if not client_gone:
                try:
                    await response.write(chunk)
                except ConnectionError:
                    client_gone = True
    except (TimeoutError, aiohttp.ClientError) as exc:
        proxy_log.warning("upstream answer cut short: %s", type(exc).__name__)
        if request.transport is not None:
            request.transport.close()
        return _Relayed(response, complete=False, body=None)
    if not client_gone:
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
    return _Relayed(response, complete=True, body=bytes(copy) if copy is not None else None)
