"""TLS contexts, made once from the config's files and made again in place on a reload:
the listeners' (the proxy's port, the admin listener) and each route's to its
upstream. Standard library only; what a certificate or key file that cannot be
loaded means is raised as ValueError naming the file, for the config's loader to
place under its key.

A listener's context speaks TLS 1.2 and 1.3 with the standard library's default
(modern) ciphers, offers ALPN ``http/1.1`` only, and, given a CA for clients, asks
each client for a certificate, verifies it against that CA, and refuses the
handshake without one when it is required: that CA alone, never the system's.
Reloading puts the new certificate and key into the same context: connections open
keep what they were made with, new ones get the new pair, and a pair that cannot
be loaded leaves the context as it was. (A context cannot forget a CA it trusts, so
another client CA takes a restart.)

An upstream's context verifies the upstream's certificate against the system's CAs,
or the route's CA alone, for the route's ``server_name`` or the upstream's host, and
presents the route's client certificate when it has one; ``verify: false`` turns
verification off (the proxy warns at start).
"""

from __future__ import annotations

import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["ClientTLS", "ServerTLS", "client_context", "reload_server", "server_context", "subject"]

_ALPN = ["http/1.1"]


@dataclass(frozen=True, slots=True)
class ServerTLS:
    """A listener's certificate chain and key (PEM files), and the CA that signs the
    client certificates it asks for (none: it asks for none)."""

    cert: str
    key: str
    client_ca: str | None = None
    require_client_cert: bool = False


@dataclass(frozen=True, slots=True)
class ClientTLS:
    """How the proxy speaks TLS to one upstream."""

    ca: str | None = None
    """The CA file the upstream's certificate must chain to; None: the system's."""
    cert: str | None = None
    key: str | None = None
    """The client certificate the proxy presents (mutual TLS), and its key."""
    server_name: str | None = None
    """The name sent (SNI) and verified; None: the upstream's host."""
    verify: bool = True


def server_context(spec: ServerTLS) -> ssl.SSLContext:
    """A listener's context; ValueError naming the file that cannot be loaded."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # the standard library's ciphers
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(_ALPN)
    context.options |= (
        ssl.OP_NO_COMPRESSION | ssl.OP_CIPHER_SERVER_PREFERENCE | ssl.OP_NO_RENEGOTIATION
    )
    _load_chain(context, spec.cert, spec.key)
    if spec.client_ca is not None:
        _load_ca(context, spec.client_ca)
        context.verify_mode = ssl.CERT_REQUIRED if spec.require_client_cert else ssl.CERT_OPTIONAL
    return context


def reload_server(context: ssl.SSLContext, spec: ServerTLS) -> None:
    """Load ``spec``'s certificate and key into ``context`` (a reload): new handshakes
    present them. ValueError naming the file, with the context left as it was, when
    the pair cannot be loaded."""
    _load_chain(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), spec.cert, spec.key)  # a trial
    _load_chain(context, spec.cert, spec.key)


def client_context(spec: ClientTLS | None) -> ssl.SSLContext:
    """An upstream's context; ValueError naming the file that cannot be loaded."""
    spec = spec or ClientTLS()
    if spec.ca is None:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)  # the system's CAs
    else:  # that CA alone (hostnames checked and certificates required, as by default)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        _load_ca(context, spec.ca)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(_ALPN)
    if spec.cert is not None and spec.key is not None:
        _load_chain(context, spec.cert, spec.key)
    if not spec.verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def subject(peercert: dict[str, Any] | None) -> dict[str, str]:
    """A verified peer certificate's subject as ``{"CN": ..., "O": ...}`` (short
    names for the usual attributes); empty without one."""
    if not peercert:
        return {}
    found: dict[str, str] = {}
    for rdn in peercert.get("subject", ()):
        for name, value in rdn:
            found.setdefault(_SHORT.get(name, name), value)
    return found


def parse_subject(text: str) -> dict[str, str]:
    """``CN=worker-a, O=Acme`` as a mapping; ValueError when it is not one."""
    found: dict[str, str] = {}
    for part in _split(text):
        name, sep, value = part.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value:
            raise ValueError(f"expected ATTRIBUTE=VALUE pairs such as CN=worker-a, not {part!r}")
        if name not in _KNOWN:
            raise ValueError(f"{name} is not one of {', '.join(sorted(_KNOWN, key=str.lower))}")
        if name in found:
            raise ValueError(f"{name} is given twice")
        found[name] = value
    if not found:
        raise ValueError("expected ATTRIBUTE=VALUE pairs such as CN=worker-a")
    return found


def _split(text: str) -> Iterable[str]:
    return (part for part in text.split(",") if part.strip()) if text.strip() else ()


_SHORT = {
    "commonName": "CN",
    "organizationName": "O",
    "organizationalUnitName": "OU",
    "countryName": "C",
    "localityName": "L",
    "stateOrProvinceName": "ST",
    "emailAddress": "emailAddress",
    "serialNumber": "serialNumber",
}


_KNOWN = frozenset(_SHORT.values())


def _load_chain(context: ssl.SSLContext, cert: str, key: str) -> None:
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(
            f"cannot load the certificate {cert} with its key {key}: {_why(exc)}"
        ) from None


def _load_ca(context: ssl.SSLContext, ca: str) -> None:
    try:
        context.load_verify_locations(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load the CA certificates {ca}: {_why(exc)}") from None


def _why(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return exc.reason or str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return type(exc).__name__
