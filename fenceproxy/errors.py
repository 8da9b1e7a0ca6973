"""The one exception tree of fenceproxy, and the problem type of every refusal.

    FenceProxyError
    ├── ConfigError                  a config file or option is wrong; names the file and key
    ├── ListenError                  the proxy cannot listen on its address (in use, not allowed)
    ├── InvariantError               a bug: code used against its contract; never caught on purpose
    │   ├── IllegalMove              a fenced write's attempt asked for a move its table lacks
    │   └── IllegalConnectionMove    a client connection asked for a move its table lacks
    ├── StoreError                   the store failed; the proxy fails closed (503)
    │   └── StoreLocked              another process holds the SQLite store
    ├── LeaseError                   raised by the lease client
    │   ├── LeaseLost                the lease can no longer be trusted: stop all effects
    │   ├── LeaseRefused             the lease service refused (carries its problem)
    │   └── LeaseServiceError        the lease service could not be reached or answered oddly
    └── Refusal                      answered to the client as RFC 9457 problem+json
        ├── RequestTargetMalformed   400  a path the proxy and an upstream could read differently
        ├── RequestTargetNotCanonical 400 dot or empty segments on a ``paths: refuse`` route
        ├── MethodOverrideMalformed  400  a method-override header that is repeated or not a method
        ├── RequestHeaderMalformed   400  a header value that cannot be forwarded as it came
        ├── RequestMalformed         400  the HTTP parser refused the request (bad framing, ...)
        ├── RequestHeadTooLarge      431  the request line or a header too long, or too many
        ├── HeaderTimeout            408  the request head did not arrive in time
        ├── BodyTimeout              408  the body stopped arriving for too long
        ├── ExpectationFailed        417  an Expect field asking for more than 100-continue
        ├── ClientClosedRequest      499  the client went away before its body was in
        ├── VersionNotSupported      505  a request line of another HTTP than 1.0 and 1.1
        ├── ProxyBusy                503  too many connections, or bodies held in memory
        ├── InsufficientStorage      507  no room on disk for a request body kept there
        ├── BodySpoolFailed          503  a request body could not be kept on disk
        ├── InternalError            500  a bug: logged with its traceback
        ├── NoRoute                  404  no route matches the path
        ├── BodyTooLarge             413  body above the route's limit
        ├── UnsupportedFraming       501  a transfer coding other than chunked
        ├── FencingHeaderMissing     428  job or token header absent
        ├── FencingHeaderMalformed   400  job or token header not acceptable
        ├── TokenRejected            403  a token not signed by a configured key for this job
        ├── IdempotencyKeyMalformed  400
        ├── StaleGeneration          409  a newer generation was accepted for the job
        ├── LeaseNotLive             409  a lease-checked route: the write's lease is not live
        ├── DuplicateInFlight        409  the same key is being forwarded now
        ├── DuplicateOutcomeUnknown  409  the same key was sent, its result never came back
        ├── DuplicateRejected        409  the key completed and the route does not replay
        ├── DuplicateNotStored       409  the key completed, its response was too large to keep
        ├── KeyReused                422  the same key with another method, path or body
        ├── KeyOtherCaller           422  the same key, stored or in flight for another caller
        ├── StoreUnavailable         503  the fence could not be read or recorded
        ├── StoreNotReady            503  the admin listener's /readyz: the store is not ready
        ├── JobQuarantined           503  an earlier write of the job has an unknown outcome
        ├── LeaseRequestMalformed    400  a lease request body that is not JSON
        ├── LeaseRequestInvalid      422  a lease request with missing or invalid fields
        ├── LeaseUnauthenticated     401  the lease API needs a credential it knows
        ├── AdminUnauthenticated     401  the admin listener needs a credential it knows
        ├── LeaseOutOfScope          403  the credential does not cover this job
        ├── LeaseNotFound            404  no lease was ever taken on the job
        ├── LeaseHeld                409  claim: another holder's lease is live (Retry-After)
        ├── WriteInFlight            409  claim: an older write may still reach the upstream
        ├── JobCompleted             409  the job was completed; it takes no more claims
        ├── LeaseSuperseded          409  a newer claim took the job over
        ├── LeaseExpired             409  the lease ran out (nobody has claimed it since)
        ├── LeaseReleased            409  the lease was released by its holder
        ├── LeaseMismatch            409  owner or generation is not this lease's
        └── UpstreamError                 the upstream did not give an answer
            ├── UpstreamUnreachable  502  connection refused: nothing was sent, key released
            ├── UpstreamFailed       502  reset or malformed answer after sending: outcome unknown
            └── UpstreamTimeout      504  no answer in time after sending: outcome unknown

Foreign errors are mapped into this tree by one adapter per library, each with its
table and a test that the table misses nothing the library raises there and that
what the adapter reads of the library exists:

    fenceproxy.http.httptools_parser  llhttp's request parser (httptools): refusals at
                                      the door (400, 505, and those its callbacks raise)
    fenceproxy.http.client_errors     llhttp's response parser, the socket and a
                                      deadline, under the upstream client:
                                      UpstreamError (the one place a timeout becomes
                                      UpstreamTimeout)
    fenceproxy.store.sqlite_errors    sqlite3: StoreError, StoreLocked by result code
    fenceproxy.store.asyncpg_errors   asyncpg and the network: StoreError
    fenceproxy.client.adapter         httpx, for the lease clients: LeaseServiceError

Every refusal kind carries its problem ``type``, ``status`` and ``title`` once, here;
the HTTP layer renders them and the log records them.
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar

__all__ = [
    "PROBLEM_BASE",
    "AdminUnauthenticated",
    "BodySpoolFailed",
    "BodyTimeout",
    "BodyTooLarge",
    "ClientClosedRequest",
    "ConfigError",
    "DuplicateInFlight",
    "DuplicateNotStored",
    "DuplicateOutcomeUnknown",
    "DuplicateRejected",
    "ExpectationFailed",
    "FenceProxyError",
    "FencingHeaderMalformed",
    "FencingHeaderMissing",
    "HeaderTimeout",
    "IdempotencyKeyMalformed",
    "IllegalConnectionMove",
    "IllegalMove",
    "InsufficientStorage",
    "InternalError",
    "InvariantError",
    "JobCompleted",
    "JobQuarantined",
    "KeyOtherCaller",
    "KeyReused",
    "LeaseError",
    "LeaseExpired",
    "LeaseHeld",
    "LeaseLost",
    "LeaseMismatch",
    "LeaseNotFound",
    "LeaseNotLive",
    "LeaseOutOfScope",
    "LeaseRefused",
    "LeaseReleased",
    "LeaseRequestInvalid",
    "LeaseRequestMalformed",
    "LeaseServiceError",
    "LeaseSuperseded",
    "LeaseUnauthenticated",
    "ListenError",
    "MethodOverrideMalformed",
    "MisdirectedRequest",
    "NoRoute",
    "ProxyBusy",
    "Refusal",
    "RequestHeadTooLarge",
    "RequestHeaderMalformed",
    "RequestMalformed",
    "RequestTargetMalformed",
    "RequestTargetNotCanonical",
    "StaleGeneration",
    "StoreError",
    "StoreLocked",
    "StoreNotReady",
    "StoreUnavailable",
    "TokenRejected",
    "UnsupportedFraming",
    "UpstreamError",
    "UpstreamFailed",
    "UpstreamTimeout",
    "UpstreamUnreachable",
    "VersionNotSupported",
    "WriteInFlight",
]

PROBLEM_BASE = "urn:fenceproxy:problem:"


class FenceProxyError(Exception):
    """Root of every error fenceproxy raises on purpose."""


class ConfigError(FenceProxyError):
    """A config file or command-line option is wrong.

    The message names the file, the key (as a dotted path) and what is wrong.
    """

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        self.source = source
        self.problems = problems
        self.lines = [
            f"{source}: {key}: {msg}" if key else f"{source}: {msg}" for key, msg in problems
        ]
        """One line per problem, each naming the file."""
        super().__init__("\n".join(self.lines))


class ListenError(FenceProxyError):
    """The proxy cannot listen on its address: it is in use, or not this host's."""


class InvariantError(FenceProxyError):
    """A bug: an object used against its contract (before it is open, by two readers
    at once, after it was removed). Raised where ``assert`` would be, so that
    ``python -O`` keeps it; nothing catches it on purpose, so the data plane logs it
    with its traceback and answers 500 (:class:`InternalError`)."""


class IllegalMove(InvariantError):
    """An admitted write's attempt was asked for a move its transition table
    (``fenceproxy.fence.write.TRANSITIONS``) does not list: ``event`` in ``state``."""

    def __init__(self, state: enum.Enum, event: enum.Enum) -> None:
        self.state = state
        self.event = event
        super().__init__(f"no move from {state.value!r} on {event.value!r}")


class IllegalConnectionMove(InvariantError):
    """A half of a client connection on the proxy's port was asked for a move its
    table (``fenceproxy.http.connection_states.TRANSITIONS``) does not list: ``event``
    in ``state``. Raised, never asserted, so ``python -O`` keeps it."""

    def __init__(self, state: enum.Enum, event: enum.Enum) -> None:
        self.state = state
        self.event = event
        super().__init__(f"no connection move from {state.value!r} on {event.value!r}")


class StoreError(FenceProxyError):
    """The store could not be opened, read or written."""


class StoreLocked(StoreError):
    """Another process holds the SQLite store: one proxy per SQLite file."""


class LeaseError(FenceProxyError):
    """Raised by the lease client."""


class LeaseLost(LeaseError):
    """The lease is lost, or can no longer be confirmed before its local deadline.

    The worker must stop producing effects under it.
    """


class LeaseServiceError(LeaseError):
    """The lease service could not be reached, or answered something unexpected."""


class LeaseRefused(LeaseError):
    """The lease service refused a request; ``problem`` is its RFC 9457 body."""

    def __init__(self, status: int, problem: dict[str, Any]) -> None:
        self.status = status
        self.problem = problem
        self.slug = str(problem.get("type", "")).removeprefix(PROBLEM_BASE)
        super().__init__(f"{status} {self.slug}: {problem.get('detail', '')}")


class Refusal(FenceProxyError):
    """A request the proxy answers itself, with an RFC 9457 problem body.

    Subclasses set ``slug`` (the problem type is ``PROBLEM_BASE + slug``), ``status``
    and ``title``. ``detail`` is a sentence for a person; ``extensions`` are extra
    members of the problem object (the job, the generations, ...). Values placed in
    either have been validated first: a raw header value is never echoed.
    """

    slug: ClassVar[str]
    status: ClassVar[int]
    title: ClassVar[str]
    challenge: ClassVar[str | None] = None
    """For a 401: the ``WWW-Authenticate`` value sent with it."""
    logged = False
    """Set once a line has told of it (a fenced decision's), so it is not told twice."""

    def __init__(self, detail: str, *, retry_after: float | None = None, **extensions: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.retry_after = retry_after
        """Seconds after which trying again may succeed; sent as ``Retry-After``."""
        self.extensions = extensions

    @classmethod
    def type_uri(cls) -> str:
        return PROBLEM_BASE + cls.slug

    def problem(self, instance: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = dict(self.extensions)
        body.update(type=self.type_uri(), title=self.title, status=self.status, detail=self.detail)
        if instance is not None:
            body["instance"] = instance
        return body


class RequestTargetMalformed(Refusal):
    slug, status, title = "request-target-malformed", 400, "Request path refused"


class RequestTargetNotCanonical(Refusal):
    """The path has dot segments or empty segments and its route takes it only as
    sent; the ``canonical`` member is the path the proxy would take instead."""

    slug, status, title = "request-target-not-canonical", 400, "Request path not canonical"


class MethodOverrideMalformed(Refusal):
    slug, status, title = "method-override-malformed", 400, "Method override malformed"


class RequestHeaderMalformed(Refusal):
    slug, status, title = "request-header-malformed", 400, "Request header cannot be forwarded"


class RequestMalformed(Refusal):
    slug, status, title = "request-malformed", 400, "Request cannot be parsed"


class RequestHeadTooLarge(Refusal):
    slug, status, title = "request-head-too-large", 431, "Request head too large"


class HeaderTimeout(Refusal):
    slug, status, title = "header-timeout", 408, "Request head not received in time"


class BodyTimeout(Refusal):
    slug, status, title = "body-timeout", 408, "Request body stopped arriving"


class ExpectationFailed(Refusal):
    slug, status, title = "expectation-failed", 417, "Expectation not met"


class ClientClosedRequest(Refusal):
    """Logged and counted; never seen by the client, which has gone (nginx's 499)."""

    slug, status, title = "client-closed-request", 499, "The client closed the connection"


class VersionNotSupported(Refusal):
    slug, status, title = "http-version-not-supported", 505, "HTTP version not supported"


class ProxyBusy(Refusal):
    slug, status, title = "proxy-busy", 503, "The proxy is at one of its limits"


class InsufficientStorage(Refusal):
    slug, status, title = "insufficient-storage", 507, "No room on disk for the request body"


class BodySpoolFailed(Refusal):
    slug, status, title = "body-spool-failed", 503, "The request body could not be kept on disk"


class InternalError(Refusal):
    slug, status, title = "internal-error", 500, "Internal error"


class NoRoute(Refusal):
    slug, status, title = "no-route", 404, "No route matches this path"


class MisdirectedRequest(Refusal):
    slug, status, title = "misdirected-request", 421, "Not a name this listener answers to"


class BodyTooLarge(Refusal):
    slug, status, title = "body-too-large", 413, "Request body too large"


class UnsupportedFraming(Refusal):
    slug, status, title = "unsupported-transfer-coding", 501, "Transfer coding not supported"


class FencingHeaderMissing(Refusal):
    slug, status, title = "fencing-header-missing", 428, "Fencing header required"


class FencingHeaderMalformed(Refusal):
    slug, status, title = "fencing-header-malformed", 400, "Fencing header malformed"


class TokenRejected(Refusal):
    slug, status, title = "token-rejected", 403, "Fencing token not accepted"


class IdempotencyKeyMalformed(Refusal):
    slug, status, title = "idempotency-key-malformed", 400, "Idempotency key malformed"


class StaleGeneration(Refusal):
    slug, status, title = "stale-generation", 409, "A newer generation holds this job"


class LeaseNotLive(Refusal):
    slug, status, title = "lease-not-live", 409, "The write's lease is not live"


class DuplicateInFlight(Refusal):
    slug, status, title = "duplicate-in-flight", 409, "The same request is in flight"


class DuplicateOutcomeUnknown(Refusal):
    slug, status, title = (
        "duplicate-outcome-unknown",
        409,
        "The same request was sent and its outcome is unknown",
    )


class DuplicateRejected(Refusal):
    slug, status, title = "duplicate-rejected", 409, "The same request was already applied"


class DuplicateNotStored(Refusal):
    slug, status, title = (
        "duplicate-not-stored",
        409,
        "The same request was already applied; its response was too large to replay",
    )


class KeyReused(Refusal):
    slug, status, title = (
        "idempotency-key-reused",
        422,
        "Idempotency key reused for a different request",
    )


class KeyOtherCaller(Refusal):
    """The key is on record for another caller (another credential, or a write from
    before keys were scoped to callers). Nothing of that write is told: not its answer,
    its status, nor whether it is still in flight."""

    slug, status, title = (
        "idempotency-key-other-caller",
        422,
        "Idempotency key used by another caller",
    )


class StoreUnavailable(Refusal):
    slug, status, title = "store-unavailable", 503, "Fencing store unavailable"


class StoreNotReady(Refusal):
    slug, status, title = "store-not-ready", 503, "The store is not ready"


class JobQuarantined(Refusal):
    slug, status, title = (
        "job-quarantined",
        503,
        "An earlier write of this job may still be applied by the upstream",
    )


class LeaseRequestMalformed(Refusal):
    slug, status, title = "lease-request-malformed", 400, "Lease request body is not JSON"


class LeaseRequestInvalid(Refusal):
    slug, status, title = "lease-request-invalid", 422, "Lease request fields are invalid"


class LeaseUnauthenticated(Refusal):
    slug, status, title = "lease-unauthenticated", 401, "Lease API credential required"
    challenge = 'Bearer realm="fenceproxy leases"'


class AdminUnauthenticated(Refusal):
    slug, status, title = "admin-unauthenticated", 401, "Admin listener credential required"
    challenge = 'Bearer realm="fenceproxy admin"'


class LeaseOutOfScope(Refusal):
    slug, status, title = "lease-out-of-scope", 403, "The credential does not cover this job"


class LeaseNotFound(Refusal):
    slug, status, title = "lease-not-found", 404, "No lease was ever taken on this job"


class LeaseHeld(Refusal):
    slug, status, title = "lease-held", 409, "The job is held by a live lease"


class WriteInFlight(Refusal):
    slug, status, title = (
        "write-in-flight",
        409,
        "A write of an earlier holder may still reach the upstream",
    )


class JobCompleted(Refusal):
    slug, status, title = "job-completed", 409, "The job was completed"


class LeaseSuperseded(Refusal):
    slug, status, title = "lease-superseded", 409, "A newer claim took the job over"


class LeaseExpired(Refusal):
    slug, status, title = "lease-expired", 409, "The lease expired"


class LeaseReleased(Refusal):
    slug, status, title = "lease-released", 409, "The lease was released"


class LeaseMismatch(Refusal):
    slug, status, title = "lease-mismatch", 409, "Owner or generation does not match the lease"


class UpstreamError(Refusal):
    """The upstream gave no usable answer. ``sent`` tells whether the request left."""

    sent: ClassVar[bool]


class UpstreamUnreachable(UpstreamError):
    slug, status, title = "upstream-unreachable", 502, "Upstream unreachable"
    sent = False


class UpstreamFailed(UpstreamError):
    slug, status, title = "upstream-failed", 502, "Upstream failed after the request was sent"
    sent = True


class UpstreamTimeout(UpstreamError):
    slug, status, title = "upstream-timeout", 504, "Upstream did not answer in time"
    sent = True
