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
another client CA takes a restart.) A listener's certificate that has expired is
refused as one that cannot be loaded, unless its ``allow_expired`` says to serve it:
every client would refuse it.

:func:`read_certificate` reads a certificate's subject and dates (with
``cryptography``: the standard library decodes only a peer's verified certificate),
for the warnings of a certificate near its end, the metric of its end and the
operator page.

An upstream's context verifies the upstream's certificate against the system's CAs,
or the route's CA alone, for the route's ``server_name`` or the upstream's host, and
presents the route's client certificate when it has one; ``verify: false`` turns
verification off (the proxy warns at start).
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509

__all__ = [
    "ENDING",
    "Certificate",
    "ClientTLS",
    "ServerTLS",
    "client_context",
    "read_certificate",
    "reload_server",
    "server_context",
    "subject",
]

_ALPN = ["http/1.1"]
ENDING = 14 * 86400.0
"""A certificate this close to its end (in seconds) is warned of, and flagged."""


@dataclass(frozen=True, slots=True)
class ServerTLS:
    """A listener's certificate chain and key (PEM files), and the CA that signs the
    client certificates it asks for (none: it asks for none)."""

    cert: str
    key: str
    client_ca: str | None = None
    require_client_cert: bool = False
    allow_expired: bool = False
    """Serve the certificate even once it has expired (for tests)."""


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
    _not_expired(spec)
    if spec.client_ca is not None:
        _load_ca(context, spec.client_ca)
        context.verify_mode = ssl.CERT_REQUIRED if spec.require_client_cert else ssl.CERT_OPTIONAL
    return context


def reload_server(context: ssl.SSLContext, spec: ServerTLS) -> None:
    """Load ``spec``'s certificate and key into ``context`` (a reload): new handshakes
    present them. ValueError naming the file, with the context left as it was, when
    the pair cannot be loaded. (One expired is refused before, when the config is
    read again: :func:`server_context` makes its trial.)"""
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


@dataclass(frozen=True, slots=True)
class Certificate:
    """A certificate's subject and the dates between which clients accept it (Unix
    times), read from ``file``."""

    file: str
    subject: str
    not_before: float
    not_after: float

    def concern(self, now: float) -> str | None:
        """What a client will make of it, if anything is wrong: expired, not yet valid,
        or ending within :data:`ENDING`; None when it is good for longer."""
        if now >= self.not_after:
            return f"expired on {_day(self.not_after)}: whoever verifies it refuses it"
        if now < self.not_before:
            return (
                f"is not valid before {_day(self.not_before)}: whoever verifies it refuses "
                "it until then"
            )
        if self.not_after - now <= ENDING:
            return f"ends on {_day(self.not_after)} ({self.days_left(now)} days left): renew it"
        return None

    def days_left(self, now: float) -> int:
        """Days from ``now`` to its end, to the nearest (below 0 once it has ended)."""
        return round((self.not_after - now) / 86400)


def read_certificate(file: str) -> Certificate:
    """The first certificate of the PEM file ``file`` (a chain's leaf, the one
    presented): its subject and dates. ValueError naming the file when it cannot be
    read or holds no certificate that can be decoded."""
    try:
        leaf = x509.load_pem_x509_certificate(Path(file).read_bytes())
    except OSError as exc:
        raise ValueError(f"cannot read the certificate {file}: {_why(exc)}") from None
    except ValueError as exc:
        raise ValueError(f"cannot read the certificate {file}: {exc}") from None
    subject = ", ".join(
        "".join(c if c.isprintable() else "?" for c in rdn.rfc4514_string())
        for rdn in leaf.subject.rdns
    )
    return Certificate(
        file,
        subject,
        leaf.not_valid_before_utc.timestamp(),
        leaf.not_valid_after_utc.timestamp(),
    )


def _not_expired(spec: ServerTLS) -> None:
    """ValueError naming the file when its certificate has expired, unless allowed."""
    if spec.allow_expired:
        return
    cert = read_certificate(spec.cert)
    if time.time() >= cert.not_after:
        raise ValueError(
            f"the certificate {spec.cert} ({cert.subject}) expired on "
            f"{_day(cert.not_after)}: every client refuses it; renew it "
            "(allow_expired: true serves it anyway, for tests)"
        )


def _day(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))


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
