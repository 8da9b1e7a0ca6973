"""What the config names but does not hold: the signing keys and the bearer
credentials, read from the environment variables and files it names, and the TLS
contexts and the certificates the proxy presents, made from its PEM files. Each is
read at start and again on a reload; one that is missing or cannot be used raises
ConfigError naming the file and its key.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from ..errors import ConfigError
from ..fence.tokens import SigningKeys, decode_key
from ..leases.auth import SECRET, LeaseCredentials
from ..tls import Certificate, client_context, parse_subject, read_certificate, server_context
from .schema import (
    Config,
    LeasesSpec,
    SecretSpec,
    SigningSpec,
    TracingSpec,
    UpstreamTlsSpec,
    header_value,
)

__all__ = [
    "Presented",
    "TlsContexts",
    "admin_credentials",
    "lease_credentials",
    "presented",
    "signing_keys",
    "tls_contexts",
    "tracing_headers",
]

T = TypeVar("T")


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


def tracing_headers(spec: TracingSpec | None, source: str) -> dict[str, str]:
    """The headers sent with every export of traces, those named by ``env`` or ``file``
    read; ConfigError naming ``source`` and the key of each that is missing or not a
    header value."""
    if spec is None:
        return {}
    headers, problems = {}, []
    for name, value in spec.headers.items():
        if isinstance(value, str):
            headers[name] = value
            continue
        try:
            headers[name] = header_value(_secret_text(value).strip())
        except ValueError as exc:
            problems.append((f"tracing.headers.{name}.{_source(value)}", str(exc)))
    if problems:
        raise ConfigError(source, problems)
    return headers


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
    specs: tuple[SecretSpec, ...],
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
        try:
            values.append(decode(_secret_text(spec)))
        except ValueError as exc:
            problems.append((f"{key}[{n}].{_source(spec)}", str(exc)))
    if problems:
        raise ConfigError(source, problems)
    return values


def _source(spec: SecretSpec) -> str:
    """The key a secret is read by: ``env`` or ``file``."""
    return "env" if spec.env is not None else "file"


def _secret_text(spec: SecretSpec) -> str:
    """The text of the secret ``spec`` names; ValueError, saying why, when it cannot
    be read."""
    if spec.env is not None:
        text = os.environ.get(spec.env)
        if text is None:
            raise ValueError(f"the environment variable {spec.env} is not set")
        return text
    assert spec.file is not None
    try:
        return Path(spec.file).read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {spec.file}: {exc}") from None
