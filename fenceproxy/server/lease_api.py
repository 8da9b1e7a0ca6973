"""The lease API over HTTP, served by the proxy under its ``leases.prefix``.

    POST {prefix}/{job}/claim     {"owner": "...", "ttl": 30, "wait": 10}
    POST {prefix}/{job}/renew     {"owner": "...", "generation": 7, "ttl": 30}
    POST {prefix}/{job}/complete  {"owner": "...", "generation": 7}
    POST {prefix}/{job}/release   {"owner": "...", "generation": 7}
    GET  {prefix}/{job}

JSON in and out; every refusal is problem+json with its own type. A body that is
not JSON is 400, missing or invalid fields 422 naming each field. The store's
clock decides expiry; ``ttl`` is in seconds, fractional allowed, bounded by the
config, and optional (``leases.default_ttl``).

A claim with ``wait`` is held while the job is held (``lease-held``) or has a write
in flight (``write-in-flight``), for up to that many seconds (at most
``leases.max_wait``), and asked again whenever the job may have changed: at once
when its holder releases or completes it (the store wakes it, on PostgreSQL from
any proxy: :mod:`fenceproxy.store.wakes`), when its lease runs out, and, for writes
in flight, each time this proxy clears one of the job's records or, on a store other
proxies share, on a poll backing off from 10 to 500 ms. It answers the grant as soon
as there is one, or the last refusal when the wait is over, the proxy stops or the
client has gone (then nothing more is asked, and a grant nobody can be told of is
released at once).

With credentials configured (``leases.clients``), every call needs one
(:mod:`fenceproxy.leases.auth`): 401 without, 403 for a job it does not cover. The
lease's owner is then the credential's name (``name/owner`` when the body names an
owner too, which it need not).
"""

from __future__ import annotations

import asyncio
import json
import math
import unicodedata
from asyncio import FIRST_COMPLETED as FIRST
from importlib.resources import files
from typing import TYPE_CHECKING, Annotated, Any
from urllib.parse import unquote

from multidict import CIMultiDict
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from ..config import LeasesSpec
from ..errors import (
    InvariantError,
    LeaseHeld,
    LeaseNotFound,
    LeaseRequestInvalid,
    LeaseRequestMalformed,
    NoRoute,
    Refusal,
    StoreError,
    StoreUnavailable,
    WriteInFlight,
)
from ..fence.fencing import GENERATION_MAX, parse_job
from ..fence.tokens import SigningKeys
from ..http.answer import Answer
from ..http.edge import Bodies
from ..http.request import Request
from ..leases import model as leasing
from ..leases.auth import LeaseCaller, LeaseCredentials
from ..leases.model import Lease, LeaseState
from ..log import lease_log
from ..ops.metrics import Metrics
from ..store import Store

if TYPE_CHECKING:
    from ..ops.tracing import Tracing

__all__ = ["LeaseService"]

_MAX_BODY = 64 * 1024
# On a store other proxies share, a waiting claim asks again behind a write in flight
# after this, doubling up to the cap: another proxy's record is cleared without a word
# to this one. (This proxy's own wake it, and expire by themselves: their retry_after.)
_POLL_FIRST, _POLL_MAX = 0.01, 0.5
# A waiting claim asks again after this at the latest, whatever it was told: a wake
# lost (a listening connection lost and opened again) costs no more.
_RECHECK = 5.0


def _printable(value: str) -> str:
    if any(unicodedata.category(c) in ("Cc", "Cf", "Cs") for c in value):
        raise ValueError("must not contain control or format characters")
    return value


def _seconds(value: Any) -> Any:
    if isinstance(value, bool | str):
        raise ValueError("must be a number of seconds")
    return value


Owner = Annotated[str, Field(min_length=1, max_length=256), AfterValidator(_printable)]
Seconds = Annotated[float, BeforeValidator(_seconds), Field(allow_inf_nan=False)]


def _whole(value: Any) -> Any:
    """JSON has one kind of number: ``7.0`` is the integer 7 (JSON Schema says so, and
    JavaScript sends it so). Never a string or a boolean."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Generation = Annotated[int, BeforeValidator(_whole), Field(ge=0, le=GENERATION_MAX, strict=True)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Claim(_Body):
    owner: Owner | None = None
    """Required unless the API takes credentials (see :meth:`LeaseService._owner`)."""
    ttl: Seconds | None = None
    wait: Seconds | None = None
    """How long the claim may be held waiting for the job, up to ``leases.max_wait``."""


class _Renew(_Body):
    owner: Owner | None = None
    generation: Generation
    ttl: Seconds | None = None


class _Holder(_Body):
    owner: Owner | None = None
    generation: Generation


class LeaseService:
    """Handlers for the lease API. ``store`` is set once the app has opened it, and
    ``tracing`` then, when each call is noted on its span."""

    def __init__(
        self,
        spec: LeasesSpec,
        bodies: Bodies,
        metrics: Metrics,
        keys: SigningKeys | None = None,
        credentials: LeaseCredentials | None = None,
    ) -> None:
        """Bodies are read through ``bodies``. With ``keys``, the tokens handed out are
        signed (see :mod:`fenceproxy.fence.tokens`); with ``credentials``, every call needs one."""
        self.spec = spec
        self.store: Store | None = None
        self.tracing: Tracing | None = None
        # The API described for clients in any language (OpenAPI 3.1), at this prefix.
        described = json.loads(files(__package__).joinpath("lease-api.json").read_bytes())
        self._openapi = json.dumps(_described(described, spec, credentials)).encode()
        self._openapi_path = f"{self.spec.prefix}/openapi.json"
        self._keys = keys
        self._credentials = credentials
        self._bodies = bodies
        self._metrics = metrics
        self._actions = {
            "claim": self.claim,
            "renew": self.renew,
            "complete": self.complete,
            "release": self.release,
        }

    async def handle(self, request: Request, path: str) -> Answer:
        """Answer a request whose raw ``path`` is under the prefix; everything under
        it is the lease API's, never an upstream's. A store that cannot answer (a
        database restarting or failing over) is a 503 to try again: a lease is never
        decided without it."""
        try:
            return await self._answer_call(request, path)
        except StoreError as exc:
            lease_log.error("store failed, refusing the lease call: %s", exc)
            raise StoreUnavailable(
                "the lease store could not be reached: try again (a GET of the job shows "
                "the lease as the store holds it, should an answer have been lost)"
            ) from exc

    async def _answer_call(self, request: Request, path: str) -> Answer:
        if path == self._openapi_path and request.method in ("GET", "HEAD"):
            headers: CIMultiDict[str] = CIMultiDict({"Content-Type": "application/json"})
            return Answer(200, headers, self._openapi)
        caller = None
        if self._credentials is not None:  # before anything else is told
            caller = self._credentials.authenticate(
                request.headers.get("Authorization"), request.subject
            )
        parts = path[len(self.spec.prefix) :].split("/")
        if len(parts) == 2 and parts[1] and request.method in ("GET", "HEAD"):
            return await self.show(request, _scoped_job(parts[1], caller))
        if len(parts) == 3 and parts[1] and request.method == "POST":
            action = self._actions.get(parts[2])
            if action is not None:
                return await action(request, _scoped_job(parts[1], caller), caller)
        raise NoRoute(
            f"the lease API has no {request.method} {self.spec.prefix}/...{{job}}/... endpoint "
            "like this; see claim, renew, complete, release and GET"
        )

    async def claim(self, request: Request, job: str, caller: LeaseCaller | None) -> Answer:
        body = await self._parse(request, _Claim)
        owner = _owner(body.owner, caller)
        ttl = self._ttl(body.ttl)
        wait = self._wait(body.wait)
        started = asyncio.get_running_loop().time()
        gone = request.client_gone()
        outcome, now, asked = await self._waiting(
            job,
            lambda cur, fence, now: leasing.claim(cur, fence, job, owner, ttl, now),
            wait,
            gone,
        )
        result = self._record("claim", job, owner, outcome)
        lease_log.info("claim %r by %r: generation %d", job, owner, result.generation)
        if gone.done():  # nobody to tell it holds the job: it must not hold it
            await self._change(
                "release",
                job,
                owner,
                lambda cur, fence, now: leasing.release(cur, job, owner, result.generation, now),
            )
            lease_log.info("claim %r by %r: its client left; released", job, owner)
        return self._answer(result, now, waited=asked - started if wait else None)

    async def _waiting(
        self, job: str, change: leasing.LeaseChange, wait: float, gone: asyncio.Future[None]
    ) -> tuple[Lease | Refusal, float, float]:
        """A claim's outcome, asked again while the job is held or has a write in flight,
        each time it may have changed, for up to ``wait`` seconds or until the client
        is ``gone`` (see the module's docstring); the store's clock, and when (on the
        loop's clock) the outcome was asked for: a grant came no earlier."""
        store = self._store()
        loop = asyncio.get_running_loop()
        if wait <= 0:
            asked = loop.time()
            return (*await store.change_lease(job, change), asked)
        deadline, poll = loop.time() + wait, _POLL_FIRST
        while True:
            with store.wakes.watch(job) as woken:  # before the store is read
                asked = loop.time()
                outcome, now = await store.change_lease(job, change)
                left = deadline - loop.time()
                if not isinstance(outcome, LeaseHeld | WriteInFlight) or left <= 0:
                    return outcome, now, asked
                pause = min(left, outcome.retry_after or _RECHECK, _RECHECK)
                if isinstance(outcome, WriteInFlight) and store.shared:
                    pause, poll = min(pause, poll), min(poll * 2, _POLL_MAX)
                self._metrics.claims_waiting.inc()
                try:
                    await asyncio.wait((woken, gone), timeout=pause, return_when=FIRST)
                finally:
                    self._metrics.claims_waiting.dec()
                # The proxy stops, or nobody waits for the answer: what was last told.
                if store.wakes.closed or gone.done():
                    return outcome, now, asked

    async def renew(self, request: Request, job: str, caller: LeaseCaller | None) -> Answer:
        body = await self._parse(request, _Renew)
        owner = _owner(body.owner, caller)
        ttl = None if body.ttl is None else self._ttl(body.ttl)
        return self._answer(
            *await self._change(
                "renew",
                job,
                owner,
                lambda cur, fence, now: leasing.renew(cur, job, owner, body.generation, ttl, now),
            )
        )

    async def complete(self, request: Request, job: str, caller: LeaseCaller | None) -> Answer:
        return await self._end(request, job, caller, "complete", leasing.complete)

    async def release(self, request: Request, job: str, caller: LeaseCaller | None) -> Answer:
        return await self._end(request, job, caller, "release", leasing.release)

    async def show(self, request: Request, job: str) -> Answer:
        store = self._store()
        lease, now = await store.lease(job)
        if lease is None:
            fence = await store.generation(job)
            if fence is not None:  # written to with generations from elsewhere
                raise LeaseNotFound(
                    f"no lease was ever taken on job {job!r}; its fence is at generation {fence}",
                    job_id=job,
                    fence_generation=fence,
                )
            raise LeaseNotFound(f"no lease was ever taken on job {job!r}", job_id=job)
        # A signed token is handed to its holder only (claim, renew), never to whoever
        # looks the job up: it would let them write as the holder.
        return self._answer(lease, now, with_token=self._keys is None)

    async def _end(
        self,
        request: Request,
        job: str,
        caller: LeaseCaller | None,
        action: str,
        decide: Any,
    ) -> Answer:
        body = await self._parse(request, _Holder)
        owner = _owner(body.owner, caller)
        result, now = await self._change(
            action,
            job,
            owner,
            lambda cur, fence, now: decide(cur, job, owner, body.generation, now),
        )
        lease_log.info("%s %r by %r at generation %d", result.state, job, owner, body.generation)
        return self._answer(result, now)

    async def _change(self, action: str, job: str, owner: str, change: Any) -> tuple[Lease, float]:
        """The changed lease and the store's clock when it changed; refusals raised."""
        outcome, now = await self._store().change_lease(job, change)
        return self._record(action, job, owner, outcome), now

    def _record(self, action: str, job: str, owner: str, outcome: Lease | Refusal) -> Lease:
        """``outcome``, counted by action and result, kept for the operator page and
        noted on its span; a refusal raised."""
        if self.tracing is not None:
            granted = outcome if isinstance(outcome, Refusal) else outcome.generation
            self.tracing.lease_call(self.spec.prefix, action, job, owner, granted)
        recent = self._metrics.recent
        if isinstance(outcome, Refusal):
            self._metrics.lease_call(action, outcome.slug)
            extensions = outcome.extensions
            recent.lease(action, job, owner, extensions.get("generation"), outcome.slug,
                         outcome.status, extensions.get("current_generation"))  # fmt: skip
            raise outcome
        self._metrics.lease_call(action, "granted")
        recent.lease(action, job, owner, outcome.generation)
        return outcome

    async def _parse(self, request: Request, schema: type[_Body]) -> Any:
        held = await self._bodies.read(request, _MAX_BODY, lease=True)
        try:
            data = json.loads(held.data)
        except (ValueError, RecursionError):
            raise LeaseRequestMalformed("the body must be a JSON object") from None
        finally:
            held.release()
        if not isinstance(data, dict):
            raise _invalid("(body)", "expected a JSON object")
        try:
            return schema.model_validate(data)
        except ValidationError as exc:
            errors = [
                {
                    "field": ".".join(str(p) for p in err["loc"]) or "(body)",
                    "message": err["msg"].removeprefix("Value error, "),
                }
                for err in exc.errors(include_url=False)
            ]
            detail = "; ".join(f"{e['field']}: {e['message']}" for e in errors)
            raise LeaseRequestInvalid(detail, errors=errors) from None

    def _ttl(self, ttl: float | None) -> float:
        if ttl is None:
            return self.spec.default_ttl
        if not self.spec.min_ttl <= ttl <= self.spec.max_ttl:
            raise _invalid(
                "ttl", f"must be between {self.spec.min_ttl} and {self.spec.max_ttl} seconds"
            )
        return ttl

    def _wait(self, wait: float | None) -> float:
        if wait is None:
            return 0.0
        if wait < 0:
            raise _invalid("wait", "must be 0 or more seconds")
        return min(wait, self.spec.max_wait)

    def _store(self) -> Store:
        if self.store is None:
            raise InvariantError("the lease service runs only inside a started app")
        return self.store

    def _answer(
        self, lease: Lease, now: float, *, with_token: bool = True, waited: float | None = None
    ) -> Answer:
        """``now`` is the store's clock, read in the same transaction. A claim says how
        long it was held waiting before the grant (``waited``, when it asked to wait):
        its holder times the lease from when it sent the claim plus that."""
        answer: dict[str, Any] = {
            "job_id": lease.job_id,
            "owner": lease.owner,
            "generation": lease.generation,
            "state": "expired"
            if lease.state is LeaseState.HELD and not lease.live(now)
            else lease.state.value,
            "ttl": lease.ttl,
            "lease_until": lease.lease_until,
            "expires_in": max(0.0, lease.lease_until - now),
        }
        if waited is not None:
            answer["waited"] = math.floor(waited * 1e6) / 1e6  # never more than it was
        if with_token:
            answer["token"] = (
                lease.token
                if self._keys is None
                else self._keys.sign(lease.job_id, lease.generation)
            )
        return Answer.json(answer)


def _described(
    document: dict[str, Any], spec: LeasesSpec, credentials: LeaseCredentials | None
) -> dict[str, Any]:
    """The OpenAPI file as this proxy serves it: at its prefix, with its ttl bounds,
    and the owner optional where a credential names it."""
    document["servers"] = [{"url": spec.prefix}]
    schemas = document["components"]["schemas"]
    schemas["Ttl"]["minimum"], schemas["Ttl"]["maximum"] = spec.min_ttl, spec.max_ttl
    if credentials is not None:
        for body in ("Claim", "Renew", "Holder"):
            schemas[body]["required"].remove("owner")
        document["security"] = [{"bearer": []}]
    return document


def _job(segment: str) -> str:
    """The job id, from its still-encoded path segment: bytes that are not UTF-8 are
    refused, never read as literal text."""
    return parse_job(unquote(segment, errors="surrogateescape"), "path")


def _scoped_job(segment: str, caller: LeaseCaller | None) -> str:
    """The job id of a path segment, if the caller's credential covers it."""
    job = _job(segment)
    if caller is not None:
        caller.check(job)
    return job


def _owner(chosen: str | None, caller: LeaseCaller | None) -> str:
    """The owner recorded for a request: its own, or its credential's name (qualified
    by its own, if it named one)."""
    if caller is not None:
        return caller.owner(chosen)
    if chosen is None:
        raise _invalid("owner", "Field required")
    return chosen


def _invalid(field: str, message: str) -> LeaseRequestInvalid:
    return LeaseRequestInvalid(f"{field}: {message}", errors=[{"field": field, "message": message}])
