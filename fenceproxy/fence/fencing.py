"""The fence decision, pure and without I/O.

Parsing of the fencing headers, the comparison of generations, and what an
idempotency key already on record means for a new request. The store calls
:func:`decide` inside its transaction, so the check and the record of the new
highest generation are one atomic step.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import itertools
import os
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..errors import (
    DuplicateInFlight,
    DuplicateNotStored,
    DuplicateOutcomeUnknown,
    DuplicateRejected,
    FencingHeaderMalformed,
    IdempotencyKeyMalformed,
    InvariantError,
    KeyOtherCaller,
    KeyReused,
    MethodOverrideMalformed,
    Refusal,
    StaleGeneration,
)

__all__ = [
    "DEFAULT_SCOPE_HEADERS",
    "GENERATION_MAX",
    "JOB_MAX_BYTES",
    "KEY_MAX_CHARS",
    "SHARED_SCOPE",
    "UNSCOPED",
    "Admit",
    "Busy",
    "Digest",
    "FencedWrite",
    "KeyRecord",
    "KeyState",
    "Replay",
    "StoredResponse",
    "decide",
    "fingerprint",
    "fingerprint_digest",
    "parse_generation",
    "parse_job",
    "parse_key",
    "parse_method_override",
    "scope",
    "single_field",
]

GENERATION_MAX = 2**63 - 1
JOB_MAX_BYTES = 256
KEY_MAX_CHARS = 255

_GENERATION = re.compile(r"[0-9]{1,19}", re.ASCII)
_KEY = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?", re.ASCII)
_METHOD = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,32}", re.ASCII)


def single_field(values: Sequence[str], header: str) -> str | None:
    """The one value of a fencing field (job, token or key), or None when absent.

    A field sent twice, or holding a comma-joined list, raises FencingHeaderMalformed:
    servers disagree on whether the first, the last or the list wins, so the proxy
    and the upstream could read different values.
    """
    if not values:
        return None
    if len(values) > 1 or "," in values[0]:
        raise FencingHeaderMalformed(f"{header} must be sent once, with one value", header=header)
    return values[0]


def parse_method_override(fields: Sequence[tuple[str, str]]) -> str | None:
    """The method named by the method-override fields of a request, upper-cased, or
    None when there are none. More than one field, or a value that is not one method
    token, raises MethodOverrideMalformed."""
    if not fields:
        return None
    names = ", ".join(name for name, _ in fields)
    if len(fields) > 1:
        raise MethodOverrideMalformed(
            f"more than one method override was sent ({names}); send one at most"
        )
    value = fields[0][1].strip()
    if not _METHOD.fullmatch(value):
        raise MethodOverrideMalformed(f"{names} must name one HTTP method")
    return value.upper()


def parse_generation(value: str, header: str) -> int:
    """ASCII digits only, 0 to 2**63-1; anything else raises FencingHeaderMalformed.

    ``int()`` alone would accept ``" 7"``, ``"1_0"`` and non-ASCII digits.
    """
    if not _GENERATION.fullmatch(value) or int(value) > GENERATION_MAX:
        raise FencingHeaderMalformed(
            f"{header} must be a decimal integer from 0 to {GENERATION_MAX}", header=header
        )
    return int(value)


def parse_job(value: str, source: str) -> str:
    """A job id: 1 to 256 bytes of UTF-8 without control or invisible format
    characters (which would let two ids look alike in logs).

    Raises FencingHeaderMalformed naming ``source`` (the header, or "path").
    """
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:  # surrogate-escaped bytes that were not UTF-8
        size = -1
    if not 0 < size <= JOB_MAX_BYTES or any(
        unicodedata.category(c) in ("Cc", "Cf", "Cs") for c in value
    ):
        raise FencingHeaderMalformed(
            f"the job id in {source} must be 1 to {JOB_MAX_BYTES} bytes of UTF-8 "
            "without control or format characters",
            header=source,
        )
    return value


def parse_key(value: str, header: str) -> str:
    """An idempotency key: 1 to 255 printable ASCII characters, no edge spaces."""
    if len(value) > KEY_MAX_CHARS or not _KEY.fullmatch(value):
        raise IdempotencyKeyMalformed(
            f"{header} must be 1 to {KEY_MAX_CHARS} printable ASCII characters", header=header
        )
    return value


class Digest(Protocol):
    """A hash being fed: :func:`hashlib.sha256`'s, as :func:`fingerprint_digest` gives it."""

    def update(self, data: bytes, /) -> None: ...

    def digest(self) -> bytes: ...


def fingerprint_digest(
    method: str, target: str, override: str | None = None, host: str | None = None
) -> Digest:
    """The fingerprint of a request whose body is still to come: feed it the body as
    it arrives (``update``), in any pieces, and ``digest()`` is what
    :func:`fingerprint` gives for the whole body at once. ``host`` is the ``Host``
    forwarded on a route that preserves it, where it names the resource as much as
    the path does; it never holds ``/``, which every target starts with."""
    digest = hashlib.sha256()
    if host is not None:
        digest.update(b"host\0" + host.encode("ascii") + b"\0")
    digest.update(method.encode("ascii"))
    if override is not None:
        digest.update(b">" + override.encode("ascii"))  # ">" is no method character
    digest.update(b"\0")
    digest.update(target.encode("utf-8", "surrogateescape"))
    digest.update(b"\0")
    return digest


def fingerprint(method: str, target: str, body: bytes, override: str | None = None) -> bytes:
    """What makes two requests with one key "the same request": the method (and the
    method an override names), the canonical path with the query, and the body. The
    NUL after the target keeps ``/a?x`` + ``yz`` apart from ``/a?xy`` + ``z``: a
    target never holds one."""
    digest = fingerprint_digest(method, target, override)
    digest.update(body)
    return digest.digest()


DEFAULT_SCOPE_HEADERS = ("Authorization", "Cookie")
"""Whose key is it: by default, whoever sends these credentials."""


def scope(fields: Sequence[tuple[str, Sequence[str]]]) -> bytes:
    """Who a keyed write is from, as a SHA-256 digest of the caller's credentials: each
    scope header's name (lower-case) with every value it came with, in order. Each
    part is length-prefixed, so a header's values cannot be read as another's, and a
    header sent empty is another caller than one without it. The credentials are
    never stored, only this."""
    digest = hashlib.sha256(b"fenceproxy caller scope 1\0")
    for name, values in fields:
        raw = name.lower().encode("ascii")
        digest.update(len(raw).to_bytes(4, "big") + raw + len(values).to_bytes(4, "big"))
        for value in values:
            if raw == b"authorization":
                value = signer(value)
            data = value.encode("utf-8", "surrogateescape")
            digest.update(len(data).to_bytes(4, "big") + data)
    return digest.digest()


# Schemes that sign each request anew (a date, a signature): the caller is the
# credential they name, or a client's own retry would be another caller.
_SIGV4 = re.compile(r"(AWS4-[A-Z0-9-]+) +Credential=([^/,\s]+)/", re.ASCII)
_SIGV2 = re.compile(r"(AWS) +([^:\s]+):", re.ASCII)


def signer(authorization: str) -> str:
    """The part of an ``Authorization`` value that names its caller. A request signed
    by AWS Signature Version 4 (or 2) is named by its scheme and access key id, since
    botocore and the AWS SDKs sign every retry again, with a new date and signature;
    any other value (a bearer token, Basic credentials) is its own whole self.

    The proxy cannot check a signature, so for signed requests the scope is the
    access key the request claims: the idempotency key (random, per operation) is
    what keeps another holder of the same access key id from a replay."""
    for pattern in (_SIGV4, _SIGV2):
        if (match := pattern.match(authorization)) is not None:
            return f"{match[1]} {match[2]}"
    return authorization


SHARED_SCOPE = scope(())
"""The scope of every caller on a route that scopes by no header (``scope_headers: []``)."""
UNSCOPED = b""
"""The scope of a key stored before keys were scoped to callers (by a schema that had
none): it matches no caller, so its answer is replayed to nobody."""


class KeyState(enum.StrEnum):
    """What became of a keyed write: in flight; answered, the answer kept for replay;
    or sent with no answer, so it may have been applied."""

    IN_FLIGHT = "in_flight"
    COMPLETED = "completed"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """The upstream's answer to a keyed write; ``body`` is None when it was too large."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes | None


@dataclass(frozen=True, slots=True)
class KeyRecord:
    state: KeyState
    fingerprint: bytes
    response: StoredResponse | None = None
    scope: bytes = SHARED_SCOPE
    """Whose key it is (:func:`scope`), or :data:`UNSCOPED`."""


# Turns are named by a random process prefix and a counter: unique across the proxies
# sharing a store, and cheap.
_PROCESS = os.urandom(6).hex()
_TURNS = itertools.count(1)


def _new_turn() -> str:
    return f"{_PROCESS}.{next(_TURNS)}"


@dataclass(frozen=True, slots=True)
class FencedWrite:
    """A fenced write as the decision sees it. ``key`` and ``fingerprint`` go together.

    ``turn`` names this attempt, unique across processes; once admitted, it holds the
    job's in-flight record for ``hold`` seconds (60 unless given) on the store's clock,
    or until the upstream has answered.
    """

    route: str
    job: str
    generation: int
    key: str | None = None
    fingerprint: bytes | None = None
    scope: bytes = SHARED_SCOPE
    """Who sent it (:func:`scope`): a key on record answers its own caller only."""
    replay: bool = True
    turn: str = field(default_factory=_new_turn)
    hold: float = 60.0
    check_lease: bool = False
    """Admitted only while the job's lease at ``generation`` is live on the store's
    clock (:func:`fenceproxy.leases.model.check_write`)."""
    shared: bool = False
    """Its route orders writes by generation: it may be in flight together with the
    job's other shared writes of its generation (:func:`fenceproxy.leases.model.in_the_way`)."""


@dataclass(frozen=True, slots=True)
class Admit:
    """Forward the write. ``raise_to`` is the new highest generation, if it rose."""

    raise_to: int | None


@dataclass(frozen=True, slots=True)
class Busy:
    """Another write of the job holds its in-flight record: this one may not go yet.
    ``unknown``: that write's outcome is unknown, so waiting is in vain before the
    record expires, ``retry_after`` seconds from now."""

    retry_after: float
    unknown: bool


@dataclass(frozen=True, slots=True)
class Replay:
    """Answer with the stored response; forward nothing."""

    response: StoredResponse


def decide(
    write: FencedWrite, current: int | None, key: KeyRecord | None
) -> Admit | Replay | Refusal:
    """Decide one fenced write against the job's highest generation and its key record.

    A key on record is looked at first: a retry of a write that was applied is answered
    from the record even when a newer generation has come since, because the proxy
    must not apply it twice and the stored answer is the truth about it. Before
    anything else about it, whose it is: another caller's key (or one from before keys
    had callers) tells nothing of its write, neither its answer, its status, whether
    it is in flight, nor whether the request is the same.
    """
    if key is not None:
        return _decide_key(write, key)
    if current is not None and write.generation < current:
        return StaleGeneration(
            f"generation {write.generation} is older than generation {current}, "
            f"already accepted for job {write.job!r}",
            job=write.job,
            generation=write.generation,
            current_generation=current,
        )
    if current is None or write.generation > current:
        return Admit(raise_to=write.generation)
    return Admit(raise_to=None)


def _decide_key(write: FencedWrite, key: KeyRecord) -> Replay | Refusal:
    """What a key on record says of a write that came with it (see :func:`decide`):
    whose it is and whether the request is the same first, then what became of it."""
    if write.key is None:
        raise InvariantError("a key on record for a write that came without one")
    if key.scope == UNSCOPED or not hmac.compare_digest(key.scope, write.scope):
        return KeyOtherCaller(
            "this Idempotency-Key is on record for another caller; send a key of your own",
            job=write.job,
        )
    if key.fingerprint != write.fingerprint:
        return KeyReused(
            "this Idempotency-Key was used for a request with another method, path or body",
            job=write.job,
        )
    if key.state is KeyState.IN_FLIGHT:
        return DuplicateInFlight(
            "a request with this Idempotency-Key is being forwarded now; retry later",
            job=write.job,
        )
    if key.state is KeyState.UNKNOWN:
        return DuplicateOutcomeUnknown(
            "a request with this Idempotency-Key was sent to the upstream and no answer came "
            "back; the upstream may have applied it, so it is not sent again",
            job=write.job,
        )
    return _completed(write, key)


def _completed(write: FencedWrite, key: KeyRecord) -> Replay | Refusal:
    """A completed key's answer, replayed unless the route says not to or it was too
    large to keep."""
    assert key.response is not None
    if not write.replay:
        return DuplicateRejected(
            "a request with this Idempotency-Key was already applied",
            job=write.job,
            original_status=key.response.status,
        )
    if key.response.body is None:
        return DuplicateNotStored(
            "a request with this Idempotency-Key was already applied; its response was "
            "too large to store",
            job=write.job,
            original_status=key.response.status,
        )
    return Replay(key.response)
