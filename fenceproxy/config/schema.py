"""The config file's schema: small immutable models, one per section, validated once
at start-up, and the values several sections share (durations, sizes, listen
addresses).

A value the schema refuses raises pydantic's ValidationError, which
:func:`~fenceproxy.config.loading.parse_config` turns into a ConfigError naming the
file and the key. Nothing here is re-checked per request:
:mod:`fenceproxy.http.routes` compiles the validated routes once.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)
from yarl import URL

from ..fence.fencing import DEFAULT_SCOPE_HEADERS
from ..fence.tokens import KEY_ID
from ..store.url import parse_store_url
from ..tls import ClientTLS, ServerTLS, parse_subject
from ..units import parse_duration, parse_size

__all__ = [
    "AdminClientSpec",
    "Config",
    "FenceSpec",
    "IdempotencySpec",
    "LeaseClientSpec",
    "LeasesSpec",
    "LimitsSpec",
    "ListenerTlsSpec",
    "RouteSpec",
    "SecretSpec",
    "SigningKeySpec",
    "SigningSpec",
    "TracingSpec",
    "UpstreamTlsSpec",
    "header_value",
    "is_loopback",
    "parse_listen",
]

_PORT = re.compile(r"[0-9]{1,5}", re.ASCII)
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", re.ASCII)


def _duration(value: Any) -> Any:
    """Seconds as a number, or a string such as ``"250ms"``, ``"30s"``, ``"24h"``."""
    if isinstance(value, bool):  # YAML's yes/no/on/off are not numbers
        raise ValueError("expected seconds or a duration such as 30s, not a yes/no value")
    if isinstance(value, str):
        return parse_duration(value)
    return value


def _size(value: Any) -> Any:
    """Bytes as an integer, or a string such as ``"512KiB"``, ``"10MiB"``."""
    if isinstance(value, bool):
        raise ValueError("expected bytes or a size such as 10MiB, not a yes/no value")
    if isinstance(value, str):
        return parse_size(value)
    return value


Duration = Annotated[float, BeforeValidator(_duration), Field(gt=0, allow_inf_nan=False)]
Size = Annotated[int, BeforeValidator(_size), Field(ge=0, strict=False)]
LogLevel = Annotated[
    Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
    BeforeValidator(lambda value: value.upper() if isinstance(value, str) else value),
]
OptionalDuration = Annotated[float, BeforeValidator(_duration), Field(ge=0, allow_inf_nan=False)]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a listen address's) reaches this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve beyond loopback


def parse_listen(value: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` to a pair; raises ValueError."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not _PORT.fullmatch(port) or not 0 < int(port) < 65536:
        raise ValueError("expected HOST:PORT, such as 127.0.0.1:8080 or [::1]:8080")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def _http_url(value: str, expected: str) -> URL:
    """``value`` as an ``http://`` or ``https://`` URL with a host; ValueError saying
    what was ``expected`` otherwise."""
    try:
        url = URL(value)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"not a URL: {exc}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(f"expected {expected}")
    return url


def _header_name(value: str) -> str:
    if not _TOKEN.fullmatch(value):
        raise ValueError(f"{value!r} is not a valid HTTP header name")
    return value


class FenceSpec(_Model):
    """How a route reads fencing headers. Defaults match the lease client."""

    methods: tuple[str, ...] | None = None
    """The fenced methods; None (the default) for every method but the safe ones: GET,
    HEAD, OPTIONS, PROPFIND, REPORT, SEARCH (:data:`fenceproxy.fence.write.SAFE_METHODS`)."""
    job_header: str = "Fencing-Job"
    token_header: str = "Fencing-Token"
    key_header: str = "Idempotency-Key"
    scope_headers: tuple[str, ...] = DEFAULT_SCOPE_HEADERS
    """Whose an idempotency key is: a key on record answers only a caller that sends
    these headers with the same values (absent ones included). ``[]``: one caller,
    everyone, so a key's answer is replayed to whoever repeats the request."""
    on_duplicate: Literal["replay", "reject"] = "replay"
    tokens: Literal["any", "signed"] = "any"
    """``signed``: only tokens signed by a key of ``signing`` are taken; ``any`` also
    takes plain integers. A signed token is verified on every route."""
    check_lease: bool = False
    """Forward a write only while the job's lease at the token's generation is live on
    the store's clock: refused after it expired, was released or completed."""
    mode: Literal["enforce", "report"] = "enforce"
    """``report``: decide as ``enforce`` does, forward what it would refuse or replay
    anyway, marked with ``Fencing-Decision``, counted and logged: a rollout's first step."""
    order: Literal["job", "generation"] = "job"
    """``job``: one write of a job at the upstream at a time. ``generation``: writes of
    the job's current generation may be at the upstream together (the holder's writes
    are independent of each other); a newer generation's waits for every older one."""

    @field_validator("methods")
    @classmethod
    def _methods(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("at least one method is needed; use fence: false for none")
        for method in value:
            if not _TOKEN.fullmatch(method):
                raise ValueError(f"{method!r} is not an HTTP method")
        # Written as people write them: `post` is POST.
        return tuple(dict.fromkeys(method.upper() for method in value))

    @field_validator("job_header", "token_header", "key_header")
    @classmethod
    def _headers(cls, value: str) -> str:
        return _header_name(value)

    @field_validator("scope_headers", mode="before")
    @classmethod
    def _scope_list(cls, value: Any) -> Any:
        if not isinstance(value, list | tuple):
            raise ValueError(
                "expected a list of header names, such as [Authorization, Cookie], "
                "or [] for keys shared by every caller"
            )
        return value

    @field_validator("scope_headers")
    @classmethod
    def _scope_headers(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            _header_name(name)
        if len({name.lower() for name in value}) != len(value):
            raise ValueError("a header is named twice")
        return value

    @model_validator(mode="after")
    def _distinct(self) -> FenceSpec:
        names = [self.job_header.lower(), self.token_header.lower(), self.key_header.lower()]
        if len(set(names)) != 3:
            raise ValueError("job_header, token_header and key_header must differ")
        if any(name.lower() in names for name in self.scope_headers):
            raise ValueError(
                "scope_headers must not name the job, token or key header: a caller is "
                "who sends the write, not the write itself"
            )
        return self


class RouteSpec(_Model):
    """One route: a path prefix, the upstream it forwards to, and its fencing."""

    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.-]+$")
    path: str
    upstream: str
    fence: FenceSpec | None = FenceSpec()
    """None for a pass-through route (``fence: false``)."""
    timeout: Duration = 30.0
    connect_timeout: Duration = 5.0
    quarantine: OptionalDuration = 60.0
    """After a write whose outcome is unknown, refuse the job's writes this long."""
    max_body: Size = 10 * 1024 * 1024
    match_case: bool = True
    """False for an upstream that routes paths case-insensitively (Express, ASP.NET, IIS)."""
    paths: Literal["refuse", "normalize", "exact"] = "refuse"
    """What a path with dot or empty segments gets (:mod:`fenceproxy.http.target`): 400,
    forwarded resolved, or forwarded as sent (opaque keys: S3, GCS, Swift, WebDAV)."""
    host: Literal["upstream", "preserve"] = "upstream"
    """The ``Host`` the upstream receives: its own authority, or the client's
    (signed requests, virtual-hosted upstreams)."""
    tls: UpstreamTlsSpec | None = None
    """How an ``https://`` upstream is spoken to, beyond the system's CAs."""

    @model_validator(mode="after")
    def _tls_for_https(self) -> RouteSpec:
        if self.tls is not None and not self.upstream.startswith("https://"):
            raise ValueError("tls is for an https:// upstream")
        return self

    @field_validator("fence", mode="before")
    @classmethod
    def _fence(cls, value: Any) -> Any:
        if value is False:
            return None
        if value is True or value is None:
            return FenceSpec()
        if not isinstance(value, dict | FenceSpec):
            raise ValueError("expected a mapping of fence settings, or false for no fencing")
        return value

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must start with /")
        if any(c in value for c in "?#") or any(ord(c) < 0x21 for c in value):
            raise ValueError("must be a plain path: no query, fragment, spaces or controls")
        stripped = value.replace("{job}", "")
        if "{" in stripped or "}" in stripped:
            raise ValueError("the only placeholder allowed is {job}")
        if value.count("{job}") > 1:
            raise ValueError("{job} may appear once")
        if "{job}" in value and not re.search(r"(^|/)\{job\}(/|$)", value):
            raise ValueError("{job} must be a whole path segment, as in /orders/{job}/")
        # Requests are matched in their canonical form (fenceproxy.http.target), so a path
        # that has none could never match.
        if any(c in value for c in "%;\\"):
            raise ValueError("must not hold '%', ';' or a backslash: write the path decoded")
        segments = value.split("/")[1:]
        if "." in segments or ".." in segments or "" in segments[:-1]:  # a trailing / is fine
            raise ValueError("must not hold empty, '.' or '..' segments (as in //, /./, /../)")
        return value

    @field_validator("upstream")
    @classmethod
    def _upstream(cls, value: str) -> str:
        url = _http_url(value, "http://HOST[:PORT][/base-path] or https://...")
        if url.query_string or url.fragment or url.user or url.password:
            raise ValueError("must not carry a query, fragment or credentials")
        return value


class ListenerTlsSpec(_Model):
    """TLS on a listener: its certificate chain and key (PEM files, relative to the
    config file's folder), and the CA whose client certificates it asks for."""

    cert: str = Field(min_length=1)
    key: str = Field(min_length=1)
    client_ca: str | None = Field(default=None, min_length=1)
    """Client certificates signed by this CA are verified; their subject can stand
    for a lease API credential (``leases.clients[].subject``)."""
    client_cert: Literal["optional", "required"] = "optional"
    """With ``client_ca``: whether a client without a certificate is refused."""
    allow_expired: bool = False
    """Serve ``cert`` even once it has expired (for tests); off, an expired one is
    refused at start and on a reload, as one that cannot be loaded."""

    @model_validator(mode="after")
    def _ca_for_required(self) -> ListenerTlsSpec:
        if self.client_cert == "required" and self.client_ca is None:
            raise ValueError("client_cert: required needs client_ca, the CA that signs them")
        return self

    def server(self) -> ServerTLS:
        return ServerTLS(
            self.cert,
            self.key,
            self.client_ca,
            self.client_cert == "required",
            self.allow_expired,
        )


class UpstreamTlsSpec(_Model):
    """How the proxy speaks TLS to a route's ``https://`` upstream."""

    ca: str | None = Field(default=None, min_length=1)
    """The CA file the upstream's certificate must chain to; unset: the system's."""
    cert: str | None = Field(default=None, min_length=1)
    key: str | None = Field(default=None, min_length=1)
    """A client certificate and its key, for an upstream that asks for one (mTLS)."""
    server_name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9.-]{1,253}$")
    """The name sent in the handshake (SNI) and verified; unset: the upstream's host."""
    verify: bool = True
    """false: the upstream's certificate is not verified (the proxy warns at start)."""

    @model_validator(mode="after")
    def _pair(self) -> UpstreamTlsSpec:
        if (self.cert is None) != (self.key is None):
            raise ValueError("give cert and key together, or neither")
        return self

    def client(self) -> ClientTLS:
        return ClientTLS(self.ca, self.cert, self.key, self.server_name, self.verify)


class SecretSpec(_Model):
    """A secret read from the environment or a file, never from the config itself."""

    env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    file: str | None = None
    """Relative to the config file's folder."""

    @model_validator(mode="after")
    def _one_source(self) -> SecretSpec:
        if (self.env is None) == (self.file is None):
            raise ValueError("give exactly one of env (a variable's name) or file (a path)")
        return self


class LeaseClientSpec(SecretSpec):
    """A credential of the lease API: a bearer secret (``env`` or ``file``), or a TLS
    client certificate whose subject holds every attribute of ``subject`` (with
    ``tls.client_ca``); its name (the owner of the leases taken with it) and the job
    ids it covers (all, or those starting with ``job_prefix``)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.@-]{1,64}$")
    job_prefix: str | None = Field(default=None, min_length=1, max_length=256)
    subject: str | None = None
    """``CN=worker-a`` (or ``CN=worker-a, O=Acme``): the attributes a verified client
    certificate's subject must hold."""

    @field_validator("subject")
    @classmethod
    def _subject(cls, value: str | None) -> str | None:
        if value is not None:
            parse_subject(value)
        return value

    @model_validator(mode="after")
    def _one_source(self) -> LeaseClientSpec:
        if sum(x is not None for x in (self.env, self.file, self.subject)) != 1:
            raise ValueError(
                "give exactly one of env (a variable's name), file (a path) or subject "
                "(a client certificate's, such as CN=worker-a)"
            )
        return self


class AdminClientSpec(SecretSpec):
    """A bearer credential of the admin listener."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.@-]{1,64}$")


class LeasesSpec(_Model):
    """The lease API, served by the proxy itself under ``prefix``."""

    prefix: str = "/_leases"
    default_ttl: Duration = 30.0
    min_ttl: Duration = 0.1
    max_ttl: Duration = 86400.0
    max_wait: Duration = 60.0
    """The longest a claim is held waiting for its job (its ``wait``); a longer wait
    is waited this long, then answered with the refusal."""
    clients: tuple[LeaseClientSpec, ...] = ()
    """With any, every call needs one of these credentials; with none, the API is open."""

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if not re.fullmatch(r"(/[A-Za-z0-9._~-]+)+", value):
            raise ValueError("expected a path such as /_leases, without a trailing slash")
        return value

    @model_validator(mode="after")
    def _bounds(self) -> LeasesSpec:
        if not self.min_ttl <= self.default_ttl <= self.max_ttl:
            raise ValueError("expected min_ttl <= default_ttl <= max_ttl")
        names = [client.name for client in self.clients]
        if len(set(names)) != len(names):
            raise ValueError("two clients have the same name")
        return self


class SigningKeySpec(SecretSpec):
    """One key that verifies signed tokens: unpadded base64url of 32 or more bytes."""

    id: str = Field(pattern=f"^{KEY_ID}$")


class SigningSpec(_Model):
    """Signed fencing tokens: the lease API signs with ``sign_with`` (by default the
    first key); every key listed verifies, so a key can be rotated out."""

    keys: tuple[SigningKeySpec, ...] = Field(min_length=1)
    sign_with: str | None = None

    @model_validator(mode="after")
    def _known(self) -> SigningSpec:
        ids = [key.id for key in self.keys]
        if len(set(ids)) != len(ids):
            raise ValueError("two keys have the same id")
        if self.sign_with is not None and self.sign_with not in ids:
            raise ValueError(f"sign_with names {self.sign_with!r}, which is not among the keys")
        return self


def header_value(value: str) -> str:
    """A field value as it goes on the wire: printable ASCII, on one line, without
    spaces at either end (which HTTP strips, and the OTLP exporter's client refuses
    at each export, quoting the value in its error)."""
    if not re.fullmatch(r"([\x21-\x7e]([\x20-\x7e]*[\x21-\x7e])?)?", value, re.ASCII):
        raise ValueError(
            "a header value is printable ASCII on one line, without spaces at either end"
        )
    return value


def _header_kind(value: Any) -> str:
    # Tags in parentheses, which no key has: the error names the header, not a tag.
    return "(secret)" if isinstance(value, dict | SecretSpec) else "(text)"


HeaderValue = Annotated[
    Annotated[str, Tag("(text)")] | Annotated[SecretSpec, Tag("(secret)")],
    Discriminator(_header_kind),
]
"""A header's value as written, or a secret read from ``env`` or ``file``."""


def _not_a_switch(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("expected a number from 0 to 1, such as 0.1, not a yes/no value")
    return value


# What `tracing:` runs on: the `otel` extra's SDK and OTLP/HTTP exporter.
_OTEL = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter")


def _otel_installed() -> bool:
    try:
        return all(importlib.util.find_spec(module) is not None for module in _OTEL)
    except ModuleNotFoundError:  # a package above it is missing
        return False


class TracingSpec(_Model):
    """OpenTelemetry traces of the requests, exported to a collector over OTLP/HTTP
    (:mod:`fenceproxy.ops.tracing`); they need the ``otel`` extra."""

    endpoint: str = "http://127.0.0.1:4318/v1/traces"
    """The collector's OTLP/HTTP traces URL; one without a path gets ``/v1/traces``."""
    sample_ratio: Annotated[float, BeforeValidator(_not_a_switch)] = Field(
        default=1.0, ge=0, le=1, allow_inf_nan=False
    )
    """The share of new traces recorded. A request that carries a ``traceparent`` is
    recorded as it says (sampled or not), whatever the ratio."""
    headers: dict[str, HeaderValue] = {}
    """Sent with every export: a value as written, or read from ``env`` or ``file``
    (a collector's credential, never written in the file)."""

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, value: str) -> str:
        url = _http_url(value, "http://HOST:PORT/v1/traces or https://...")
        if url.fragment or url.user or url.password:
            raise ValueError("must not carry a fragment or credentials (give them in headers)")
        if url.path in ("", "/"):
            return str(url.with_path("/v1/traces"))
        return value

    @field_validator("headers")
    @classmethod
    def _headers(cls, value: dict[str, str | SecretSpec]) -> dict[str, str | SecretSpec]:
        for name, given in value.items():
            _header_name(name)
            if isinstance(given, str):
                try:
                    header_value(given)
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from None
        return value

    @model_validator(mode="after")
    def _installed(self) -> TracingSpec:
        if not _otel_installed():
            raise ValueError(
                "traces need OpenTelemetry, which is not installed: "
                "pip install 'fenceproxy[otel]' (or leave tracing out)"
            )
        return self


class IdempotencySpec(_Model):
    """How long idempotency keys are kept and how much response each may store."""

    ttl: Duration = 24 * 3600.0
    max_response: Size = 1024 * 1024


class LimitsSpec(_Model):
    """What one client may hold of the proxy, at the door (nginx's defaults)."""

    header_timeout: Duration = 60.0
    """The whole request head must arrive within this, from its first byte (or from
    the connection's opening): 408 and the connection closed otherwise."""
    body_timeout: Duration = 60.0
    """The longest wait between two reads of a request body: 408 otherwise."""
    send_timeout: Duration = 60.0
    """The longest wait for a client to take the next part of a streamed answer: the
    connection is closed otherwise."""
    keepalive_timeout: Duration = 75.0
    """An idle keep-alive connection is closed after this."""
    max_connections: int = Field(default=10_000, ge=1)
    """Open client connections; lowered at start to fit the descriptor limit."""
    max_connections_per_client: int | None = Field(default=None, ge=1)
    """Of those, the most one client (its address) may hold; a trusted proxy's have
    no such share. Unset: a tenth of ``max_connections`` as lowered at start."""
    max_buffered: Size = 256 * 1024**2
    """Request bodies held in memory at once, every request together: beyond it,
    503 with Retry-After. Bodies kept on disk do not count. A sixteenth of it is
    kept for the lease API's calls."""
    max_buffered_per_client: Size | None = None
    """Of those, the most one client's requests may hold together; unset: a quarter
    of ``max_buffered``."""
    body_min_rate: Size = 1024
    """A body read whole (a fenced write's, a lease call's) must arrive at this many
    bytes a second at least, over every 10 s (or ``body_timeout``, when shorter):
    408 otherwise, so a body sent a byte at a time holds no share for long. 0: off."""
    body_buffer: Size = 1024 * 1024
    """A fenced write's body up to this size is held in memory; a larger one is
    written to a file in ``body_temp_path`` as it arrives, and sent from there. Left
    unset, never above ``max_buffered``."""
    body_temp_path: str | None = None
    """The folder of those files (made with mode 0700; relative to the config file's
    folder); None for ``fenceproxy-bodies-<uid>`` in the system's temporary folder."""

    @field_validator("body_temp_path")
    @classmethod
    def _temp_path(cls, value: str | None) -> str | None:
        if value is not None and (not value.strip() or "\0" in value):
            raise ValueError("expected the path of a folder")
        return value

    @property
    def buffered_per_client(self) -> int:
        return self.max_buffered_per_client or self.max_buffered // 4

    @model_validator(mode="after")
    def _buffer_fits(self) -> LimitsSpec:
        if "body_buffer" not in self.model_fields_set and self.body_buffer > self.max_buffered:
            # Not asked for: a small max_buffered brings the default down with it.
            object.__setattr__(self, "body_buffer", self.max_buffered)
        if self.body_buffer > self.max_buffered:
            raise ValueError(
                f"body_buffer ({self.body_buffer} bytes) is above max_buffered "
                f"({self.max_buffered} bytes): no body of that size could be held"
            )
        return self


class Config(_Model):
    """The whole file."""

    listen: str = "127.0.0.1:8080"
    tls: ListenerTlsSpec | None = None
    """TLS on ``listen``; a certificate renewed at the same path is loaded on SIGHUP."""
    admin: str | None = "127.0.0.1:9901"
    """The admin listener (/healthz, /readyz, /metrics); ``false`` for none."""
    admin_tls: ListenerTlsSpec | None = None
    """TLS on ``admin``."""
    admin_clients: tuple[AdminClientSpec, ...] = ()
    """With any, the admin listener needs one of these bearer credentials."""
    admin_probes: Literal["open", "closed"] = "open"
    """With ``admin_clients``: whether /healthz and /readyz need no credential."""
    allow_plaintext: bool = False
    """Let credentials and signed tokens cross a network in clear (a listener beyond
    loopback without TLS); off, such a config is refused."""
    store: str = "sqlite:///fenceproxy.db"
    workers: int = Field(default=1, ge=1, le=256)
    """Processes serving ``listen`` together (SO_REUSEPORT), each with its own event
    loop, all on the one store; ``auto``: one per core this process may run on."""
    idempotency: IdempotencySpec = IdempotencySpec()
    leases: LeasesSpec | None = None
    """The lease API; off unless the section is present (``leases: {}`` for defaults)."""
    signing: SigningSpec | None = None
    """Keys for signed fencing tokens; without them tokens are plain integers."""
    trusted_proxies: tuple[str, ...] = ()
    shutdown_timeout: Duration = 30.0
    limits: LimitsSpec = LimitsSpec()
    log_format: Literal["text", "json"] = "text"
    """``json``: one JSON object per line, a decision's fields as its members."""
    log_levels: dict[str, LogLevel] = {}
    """Levels per logger, such as ``fenceproxy.decisions: DEBUG`` (every decision)."""
    tracing: TracingSpec | None = None
    """OpenTelemetry traces; off unless the section is present (``tracing: {}`` sends
    them to a collector on this machine)."""
    routes: tuple[RouteSpec, ...] = Field(default=(), validate_default=True)
    """At least one, unless the proxy serves its lease API alone."""

    @field_validator("listen", mode="before")
    @classmethod
    def _listen(cls, value: Any) -> Any:
        if not isinstance(value, str):
            raise ValueError("expected HOST:PORT, such as 127.0.0.1:8080, not a bare port")
        parse_listen(value)
        return value

    @field_validator("admin", mode="before")
    @classmethod
    def _admin(cls, value: Any) -> Any:
        if value is False or value is None or value == "off":
            return None
        if not isinstance(value, str):
            raise ValueError("expected HOST:PORT, such as 127.0.0.1:9901, or false for none")
        parse_listen(value)
        return value

    @field_validator("tls", "admin_tls", mode="before")
    @classmethod
    def _tls_switch(cls, value: Any) -> Any:
        return None if value is False else value

    @model_validator(mode="after")
    def _admin_apart(self) -> Config:
        if self.admin is not None and parse_listen(self.admin) == parse_listen(self.listen):
            raise ValueError("admin must listen on another address than listen")
        return self

    @field_validator("store")
    @classmethod
    def _store(cls, value: str) -> str:
        parse_store_url(value)
        return value

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, value: Any) -> Any:
        if value == "auto":
            return len(os.sched_getaffinity(0))
        if isinstance(value, str) and value.isdigit():  # --workers 2
            return int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError("expected a number of processes, such as 2, or auto (one per core)")
        return value

    @model_validator(mode="after")
    def _workers_share_a_store(self) -> Config:
        if self.workers > 1 and parse_store_url(self.store).backend == "sqlite":
            raise ValueError(
                f"workers: {self.workers} needs a PostgreSQL store: a SQLite file is opened "
                "by one process only (in exclusive locking mode, which makes the store's "
                "cache of fences authoritative), and SQLite commits one transaction at a "
                "time, so more processes on one file would wait on its lock, not write "
                "faster; use workers: 1 with SQLite"
            )
        return self

    @field_validator("trusted_proxies")
    @classmethod
    def _trusted(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for net in value:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError:
                raise ValueError(f"{net!r} is not an IP address or network") from None
        return value

    @field_validator("leases", "tracing", mode="before")
    @classmethod
    def _section_switch(cls, value: Any) -> Any:
        # `leases:` (or `tracing:`) with nothing under it, or `true`, turns it on.
        if value is None or value is True:
            return {}
        if value is False:
            return None
        return value

    @model_validator(mode="after")
    def _leases_apart(self) -> Config:
        if self.leases is not None:
            prefix = self.leases.prefix
            for route in self.routes:
                if route.path == prefix or route.path.startswith(prefix + "/"):
                    raise ValueError(
                        f"route {route.name!r} is under the lease API's prefix {self.leases.prefix}"
                    )
        return self

    @model_validator(mode="after")
    def _signed_routes_have_keys(self) -> Config:
        if self.signing is None:
            for n, route in enumerate(self.routes):
                if route.fence is not None and route.fence.tokens == "signed":
                    raise ValueError(
                        f"routes[{n}].fence.tokens is signed, and no signing keys are "
                        "configured (signing.keys)"
                    )
        return self

    @model_validator(mode="after")
    def _checked_routes_see_leases(self) -> Config:
        # A SQLite file has one process: without its lease API no lease ever exists
        # there. A PostgreSQL store may be shared with proxies that serve the API.
        if self.leases is None and parse_store_url(self.store).backend == "sqlite":
            for n, route in enumerate(self.routes):
                if route.fence is not None and route.fence.check_lease:
                    raise ValueError(
                        f"routes[{n}].fence.check_lease is on, and no lease API shares "
                        "this SQLite store (add leases:)"
                    )
        return self

    @field_validator("routes")
    @classmethod
    def _unique(cls, value: tuple[RouteSpec, ...], info: ValidationInfo) -> tuple[RouteSpec, ...]:
        if not value and info.data.get("leases") is None:
            raise ValueError("at least one route is needed (or leases: for a lease API alone)")
        for attr in ("name", "path"):
            seen: set[str] = set()
            for route in value:
                item = getattr(route, attr)
                if item in seen:
                    raise ValueError(f"two routes have the {attr} {item!r}")
                seen.add(item)
        return value
