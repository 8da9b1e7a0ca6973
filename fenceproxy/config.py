"""The YAML config as small immutable models, validated once at start-up.

Every error names the file, the key (``routes[0].upstream``) and what is wrong, and
is raised as :class:`~fenceproxy.errors.ConfigError`. Nothing here is re-checked per
request: :mod:`fenceproxy.http.routes` compiles the validated routes once.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import ssl
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from yarl import URL

from .errors import ConfigError
from .fence.fencing import DEFAULT_SCOPE_HEADERS
from .fence.tokens import KEY_ID, SigningKeys, decode_key
from .leases.auth import SECRET, LeaseCredentials
from .spool import SpoolFolder, default_folder
from .store.url import absolute_store_url, parse_store_url
from .tls import (
    Certificate,
    ClientTLS,
    ServerTLS,
    client_context,
    parse_subject,
    read_certificate,
    server_context,
)
from .units import parse_duration, parse_size

__all__ = [
    "Config",
    "FenceSpec",
    "IdempotencySpec",
    "LeaseClientSpec",
    "LeasesSpec",
    "LimitsSpec",
    "RouteSpec",
    "SigningKeySpec",
    "SigningSpec",
    "lease_credentials",
    "load_config",
    "parse_config",
    "parse_listen",
    "signing_keys",
]

T = TypeVar("T")
S = TypeVar("S", bound="_SecretSpec")

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
        try:
            url = URL(value)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"not a URL: {exc}") from None
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError("expected http://HOST[:PORT][/base-path] or https://...")
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


class _SecretSpec(_Model):
    """A secret read from the environment or a file, never from the config itself."""

    env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    file: str | None = None
    """Relative to the config file's folder."""

    @model_validator(mode="after")
    def _one_source(self) -> _SecretSpec:
        if (self.env is None) == (self.file is None):
            raise ValueError("give exactly one of env (a variable's name) or file (a path)")
        return self


class LeaseClientSpec(_SecretSpec):
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


class AdminClientSpec(_SecretSpec):
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


class SigningKeySpec(_SecretSpec):
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

    @field_validator("leases", mode="before")
    @classmethod
    def _leases_switch(cls, value: Any) -> Any:
        # `leases:` with nothing under it, or `leases: true`, turns the API on.
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


def _in_clear(config: Config) -> list[tuple[str, str]]:
    """What of ``config`` would cross a network in clear, by the key that would mend
    it: credentials and tokens that let their bearer act as someone, on a listener
    beyond loopback without TLS, unless ``allow_plaintext`` says the network is
    trusted; and a lease client named by a certificate without a CA to verify it."""
    problems = []
    leases = config.leases
    named = leases is not None and any(c.subject is not None for c in leases.clients)
    if named and (config.tls is None or config.tls.client_ca is None):
        problems.append((
            "tls.client_ca",
            "a lease client named by a certificate subject (leases.clients[].subject) "
            "needs the CA whose client certificates are verified",
        ))  # fmt: skip
    if config.allow_plaintext:
        return problems
    secrets = []
    if leases is not None and any(c.subject is None for c in leases.clients):
        secrets.append("the lease API's bearer credentials (leases.clients)")
    if config.signing is not None:
        secrets.append("signed fencing tokens (signing)")
    if secrets and config.tls is None and not is_loopback(parse_listen(config.listen)[0]):
        problems.append((
            "tls",
            f"{' and '.join(secrets)} would cross the network in clear on {config.listen}: "
            "give tls (a certificate and its key), listen on loopback, or set "
            "allow_plaintext: true for a network you trust",
        ))  # fmt: skip
    admin = config.admin
    bare = admin is not None and config.admin_clients and config.admin_tls is None
    if bare and admin is not None and not is_loopback(parse_listen(admin)[0]):
        problems.append((
            "admin_tls",
            f"the admin listener's bearer credentials (admin_clients) would cross the "
            f"network in clear on {admin}: give admin_tls, listen on loopback, or set "
            "allow_plaintext: true for a network you trust",
        ))  # fmt: skip
    return problems


def signing_keys(spec: SigningSpec | None, source: str) -> SigningKeys | None:
    """The signing keys' material, from the environment variables and files the
    config names; ConfigError naming ``source`` and the key when one is missing or
    not a key."""
    if spec is None:
        return None
    material = _read_secrets(source, "signing.keys", spec.keys, decode_key)
    return SigningKeys(
        {key.id: value for key, value in zip(spec.keys, material, strict=True)},
        spec.sign_with or spec.keys[0].id,
    )


def lease_credentials(spec: LeasesSpec | None, source: str) -> LeaseCredentials | None:
    """The lease API's credentials, read as :func:`signing_keys` reads keys; None when
    the API is off or open."""
    if spec is None or not spec.clients:
        return None
    places = tuple(n for n, client in enumerate(spec.clients) if client.subject is None)
    bearers = [spec.clients[n] for n in places]
    secrets = iter(_read_secrets(source, "leases.clients", tuple(bearers), _bearer_secret, places))
    try:
        return LeaseCredentials(
            (client.name, next(secrets), client.job_prefix) for client in bearers
        ).with_subjects(
            (client.name, parse_subject(client.subject), client.job_prefix)
            for client in spec.clients
            if client.subject is not None
        )
    except ValueError as exc:
        raise ConfigError(source, [("leases.clients", str(exc))]) from None


def admin_credentials(config: Config, source: str) -> LeaseCredentials | None:
    """The admin listener's bearer credentials, read as the lease API's; None: open."""
    if not config.admin_clients:
        return None
    secrets = _read_secrets(source, "admin_clients", config.admin_clients, _bearer_secret)
    try:
        return LeaseCredentials(
            (client.name, secret, None)
            for client, secret in zip(config.admin_clients, secrets, strict=True)
        )
    except ValueError as exc:
        raise ConfigError(source, [("admin_clients", str(exc))]) from None


RESTART_ONLY = (
    "listen",
    "tls",
    "admin",
    "admin_tls",
    "store",
    "workers",
    "idempotency.ttl",
    "shutdown_timeout",
    "limits.body_temp_path",
)
"""What a reload cannot change: where it listens, what it keeps its state in."""

Reader = Callable[[Mapping[str, Any] | None], Config]
"""Reads the config file again, keeping the given dotted keys' values (``keep`` of
:func:`load_config`)."""


def restart_only(running: Config, config: Config) -> dict[str, Any]:
    """What ``config`` changes that only a restart can: each dotted key of
    :data:`RESTART_ONLY` (``store``, ``idempotency.ttl``, ...) with its value in
    ``running``, to keep on a reload."""
    kept = {}
    for name in RESTART_ONLY:
        value = setting(running, name)
        if setting(config, name) != value:
            kept[name] = False if value is None else value  # admin: false
    return kept


def setting(config: Config, name: str) -> Any:
    """The value of a dotted key (``limits.body_temp_path``)."""
    value: Any = config
    for part in name.split("."):
        value = getattr(value, part)
    return value


def tls_contexts(config: Config, source: str) -> TlsContexts:
    """Every TLS context the config asks for, made from its files; ConfigError naming
    the file and the key of each that cannot be loaded."""
    problems: list[tuple[str, str]] = []

    def make(key: str, build: Callable[[], ssl.SSLContext]) -> ssl.SSLContext | None:
        try:
            return build()
        except ValueError as exc:
            problems.append((key, str(exc)))
            return None

    tls, admin_tls = config.tls, config.admin_tls
    contexts = TlsContexts(
        listener=None if tls is None else make("tls", lambda: server_context(tls.server())),
        admin=None if admin_tls is None else make(
            "admin_tls", lambda: server_context(admin_tls.server())
        ),
        upstreams={
            route.name: context
            for n, route in enumerate(config.routes)
            if route.tls is not None
            and (context := make(f"routes[{n}].tls", _client(route.tls))) is not None
        },
    )  # fmt: skip
    if problems:
        raise ConfigError(source, problems)
    return contexts


@dataclass(frozen=True, slots=True)
class Presented:
    """A certificate the proxy presents: a listener's (``label`` listener, ``name``
    proxy or admin) or a route's to its upstream (``label`` route, ``name`` the
    route's), which the config names at ``key``."""

    label: Literal["listener", "route"]
    name: str
    key: str
    certificate: Certificate

    def __str__(self) -> str:
        if self.label == "route":
            return f"the client certificate of route {self.name!r} ({self.key}.cert)"
        return f"the {self.name} listener's certificate ({self.key}.cert)"


def presented(config: Config, source: str) -> tuple[Presented, ...]:
    """Every certificate ``config`` has the proxy present, with its subject and dates
    read from its file; ConfigError naming the key of each that cannot be read."""
    named: list[tuple[Literal["listener", "route"], str, str, Any]] = [
        ("listener", "proxy", "tls", config.tls),
        ("listener", "admin", "admin_tls", config.admin_tls),
        *(("route", r.name, f"routes[{n}].tls", r.tls) for n, r in enumerate(config.routes)),
    ]
    found, problems = [], []
    for label, name, key, spec in named:
        file: str | None = None if spec is None else spec.cert
        if file is None:
            continue
        try:
            found.append(Presented(label, name, key, read_certificate(file)))
        except ValueError as exc:
            problems.append((f"{key}.cert", str(exc)))
    if problems:
        raise ConfigError(source, problems)
    return tuple(found)


def _client(spec: UpstreamTlsSpec) -> Callable[[], ssl.SSLContext]:
    return lambda: client_context(spec.client())


@dataclass(frozen=True)
class TlsContexts:
    """The TLS contexts of a config: its listeners', and each route's to its upstream."""

    listener: ssl.SSLContext | None
    admin: ssl.SSLContext | None
    upstreams: dict[str, ssl.SSLContext]


def _bearer_secret(text: str) -> str:
    text = text.strip()
    if not SECRET.fullmatch(text):
        raise ValueError(
            "a credential is 32 to 1024 characters of A-Z a-z 0-9 . _ ~ + / - "
            "(fenceproxy keys generate prints one)"
        )
    return text


def _read_secrets(
    source: str,
    key: str,
    specs: tuple[_SecretSpec, ...],
    decode: Callable[[str], T],
    positions: tuple[int, ...] | None = None,
) -> list[T]:
    """Each secret of ``specs`` (the list at ``key``, each at its place in
    ``positions`` when they are not all of it), decoded; ConfigError naming
    ``source`` and every one that is missing or malformed. A relative file is taken
    from the working directory: ``load_config`` has made the file's own relative paths
    absolute."""
    values: list[T] = []
    problems: list[tuple[str, str]] = []
    for n, spec in zip(positions or range(len(specs)), specs, strict=True):
        if spec.env is not None:
            where, text = f"{key}[{n}].env", os.environ.get(spec.env)
            if text is None:
                problems.append((where, f"the environment variable {spec.env} is not set"))
                continue
        else:
            assert spec.file is not None
            where = f"{key}[{n}].file"
            try:
                text = Path(spec.file).read_text(encoding="ascii")
            except (OSError, UnicodeDecodeError) as exc:
                problems.append((where, f"cannot read {spec.file}: {exc}"))
                continue
        try:
            values.append(decode(text))
        except ValueError as exc:
            problems.append((where, str(exc)))
    if problems:
        raise ConfigError(source, problems)
    return values


def _key(loc: tuple[int | str, ...]) -> str:
    """``("routes", 0, "upstream")`` to ``routes[0].upstream``, without pydantic's
    internal validator names."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.startswith("function-"):
            out += f".{part}" if out else part
    return out


def _unknown_key(loc: tuple[int | str, ...]) -> str:
    """What to say of a key no model has at ``loc``: the closest known one, if any."""
    model: type[BaseModel] | None = Config
    for part in loc[:-1]:
        if isinstance(part, str) and model is not None and part in model.model_fields:
            model = _model_in(model.model_fields[part].annotation)
    known = list(model.model_fields) if model is not None else []
    close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
    if close:
        return f"unknown key; did you mean {close[0]!r}?"
    return "unknown key" + (f"; known keys here: {', '.join(known)}" if known else "")


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds, directly, optionally or as the items of a tuple."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if (found := _model_in(arg)) is not None:
            return found
    return None


def parse_config(
    data: Any,
    source: str,
    overrides: Mapping[str, str] | None = None,
    keep: Mapping[str, Any] | None = None,
) -> Config:
    """Validate already-parsed YAML. ``overrides`` come from the command line;
    ``keep`` maps dotted keys (``idempotency.ttl``) to the values they keep whatever
    the file says (a reload keeps what changes only with a restart)."""
    if not isinstance(data, dict):
        raise ConfigError(source, [("", "the top level must be a mapping of keys")])
    merged = {**data, **(overrides or {})}
    for dotted, value in (keep or {}).items():
        node = merged
        *parents, last = dotted.split(".")
        for part in parents:
            child = node.get(part)
            node[part] = node = dict(child) if isinstance(child, dict) else {}
        node[last] = value
    try:
        config = Config.model_validate(merged)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        locs = [err["loc"] for err in errors]
        problems = []
        for err in errors:
            # An error on a container is only the echo of one inside it.
            if any(len(o) > len(err["loc"]) and o[: len(err["loc"])] == err["loc"] for o in locs):
                continue
            key = _key(err["loc"])
            if overrides and key in overrides:
                key = f"{key} (from --{key})"
            msg = err["msg"].removeprefix("Value error, ")
            msg = msg.replace("Tuple", "List").replace("tuple", "list")
            if err["type"] == "extra_forbidden":
                msg = _unknown_key(err["loc"])
            problems.append((key, msg))
        raise ConfigError(source, problems) from None
    if problems := _in_clear(config):
        raise ConfigError(source, problems)
    return config


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping: PyYAML would keep
    the last one, so a second ``routes:`` would silently replace the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:
                raise yaml.constructor.ConstructorError(
                    None, None, "a mapping key must be a plain value", key_node.start_mark
                ) from None
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_config(
    path: str | Path,
    overrides: Mapping[str, str] | None = None,
    keep: Mapping[str, Any] | None = None,
) -> Config:
    """Read and validate a config file (``keep``: see :func:`parse_config`).

    A relative SQLite path in the file is resolved against the file's folder; one in
    ``overrides`` (``--store``) against the working directory.

    Raises ConfigError naming the file for an unreadable file, a YAML syntax error
    (with its line and column), or any invalid key.
    """
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(source, [("", f"cannot read: {exc}")]) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no arbitrary objects
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f"line {mark.line + 1}, column {mark.column + 1}: "
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(source, [("", f"{where}invalid YAML: {problem}")]) from None
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError) as exc:
        # PyYAML's constructors raise these for values such as `!!int 30s`, a
        # 5000-digit number or nesting too deep to build.
        detail = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise ConfigError(source, [("", f"invalid YAML value: {detail}")]) from None
    config = parse_config(data, source, overrides, keep)
    base = os.getcwd() if overrides and "store" in overrides else Path(path).parent
    update: dict[str, Any] = {"store": absolute_store_url(config.store, base)}
    folder = Path(path).parent.absolute()
    if config.signing is not None:
        keys = _absolute_files(config.signing.keys, folder)
        update["signing"] = config.signing.model_copy(update={"keys": keys})
    if config.leases is not None:
        clients = _absolute_files(config.leases.clients, folder)
        update["leases"] = config.leases.model_copy(update={"clients": clients})
    if config.admin_clients:
        update["admin_clients"] = _absolute_files(config.admin_clients, folder)
    for key in ("tls", "admin_tls"):
        spec = getattr(config, key)
        if spec is not None:
            update[key] = _absolute_paths(spec, folder, ("cert", "key", "client_ca"))
    if any(route.tls is not None for route in config.routes):
        update["routes"] = tuple(
            route.model_copy(
                update={"tls": _absolute_paths(route.tls, folder, ("ca", "cert", "key"))}
            )
            if route.tls is not None
            else route
            for route in config.routes
        )
    # The folder in full, the default's too: what a reload compares and keeps.
    temp_path = str(folder / (config.limits.body_temp_path or default_folder()))
    update["limits"] = config.limits.model_copy(update={"body_temp_path": temp_path})
    config = config.model_copy(update=update)
    # Every secret present and well-formed, now; the folder for bodies usable.
    signing_keys(config.signing, source)
    lease_credentials(config.leases, source)
    admin_credentials(config, source)
    tls_contexts(config, source)
    try:
        SpoolFolder(temp_path).prepare()
    except ValueError as exc:
        raise ConfigError(source, [("limits.body_temp_path", str(exc))]) from None
    return config


M = TypeVar("M", bound=BaseModel)


def _absolute_paths(spec: M, folder: Path, keys: tuple[str, ...]) -> M:
    """``spec`` with each of its file ``keys`` that is set made absolute against the
    config file's ``folder``."""
    update = {key: str(folder / value) for key in keys if (value := getattr(spec, key)) is not None}
    return spec.model_copy(update=update)


def _absolute_files(specs: tuple[S, ...], folder: Path) -> tuple[S, ...]:
    return tuple(
        spec if spec.file is None else spec.model_copy(update={"file": str(folder / spec.file)})
        for spec in specs
    )
