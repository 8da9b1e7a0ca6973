"""Who may use the lease API: bearer credentials, or TLS client certificates by their
subject, each with a name and optionally a job-id prefix it is limited to. Pure,
without I/O: the secrets are read by the config loader, the certificates verified by
the listener's TLS.

A request names its credential in ``Authorization: Bearer <secret>``. The secret is
compared with every configured one in constant time (as SHA-256 digests, so neither
the length nor the position of a mismatch shows), all of them each time. The name of
the credential that matched becomes the lease's owner: ``name`` alone, or
``name/owner`` when the request also names an owner of its own (a worker among several
sharing one credential). So a client can renew, complete or release only a lease
taken under its own credential.

A request without ``Authorization`` whose connection presented a verified client
certificate is the caller of the first credential whose ``subject`` attributes
(``CN=worker-a``) its certificate's subject holds, every one of them.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..errors import LeaseOutOfScope, LeaseUnauthenticated

__all__ = ["SECRET", "LeaseCaller", "LeaseCredentials"]

SECRET = re.compile(r"[A-Za-z0-9._~+/-]{32,1024}=*", re.ASCII)
"""What a bearer secret may be: an RFC 6750 token68 of 32 characters or more
(``fenceproxy keys generate`` prints one)."""
_BEARER = re.compile(r"Bearer +([A-Za-z0-9._~+/-]+=*) *", re.ASCII | re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class LeaseCaller:
    """The authenticated caller of one request."""

    name: str
    job_prefix: str | None

    def check(self, job: str) -> None:
        """Raise LeaseOutOfScope unless this credential covers ``job``."""
        if self.job_prefix is not None and not job.startswith(self.job_prefix):
            raise LeaseOutOfScope(
                f"the credential {self.name!r} covers only jobs whose id starts with "
                f"{self.job_prefix!r}",
                credential=self.name,
            )

    def owner(self, chosen: str | None) -> str:
        """The lease owner recorded for this caller, given the owner its request named."""
        return self.name if chosen is None else f"{self.name}/{chosen}"


class LeaseCredentials:
    """The configured credentials: ``(name, secret, job_prefix)`` each, and those
    named by a certificate subject (:meth:`with_subjects`)."""

    __slots__ = ("_callers", "_subjects")

    def __init__(self, credentials: Iterable[tuple[str, str, str | None]]) -> None:
        self._callers = tuple(
            (_digest(secret), LeaseCaller(name, prefix)) for name, secret, prefix in credentials
        )
        if len({digest for digest, _ in self._callers}) != len(self._callers):
            raise ValueError("two credentials have the same secret")
        self._subjects: tuple[tuple[Mapping[str, str], LeaseCaller], ...] = ()

    def with_subjects(
        self, subjects: Iterable[tuple[str, Mapping[str, str], str | None]]
    ) -> LeaseCredentials:
        """Add credentials named by a client certificate's subject attributes."""
        self._subjects += tuple(
            (dict(attributes), LeaseCaller(name, prefix)) for name, attributes, prefix in subjects
        )
        return self

    def authenticate(
        self, authorization: str | None, subject: Mapping[str, str] | None = None
    ) -> LeaseCaller:
        """The caller whose secret ``authorization`` (the header's value) carries, or,
        without one, whose certificate ``subject`` (verified by TLS) holds;
        LeaseUnauthenticated when there is neither, it is not a bearer secret, or no
        credential has it."""
        if authorization is None and subject:
            for attributes, caller in self._subjects:
                if all(subject.get(name) == value for name, value in attributes.items()):
                    return caller
        m = None if authorization is None else _BEARER.fullmatch(authorization)
        if m is None:
            raise LeaseUnauthenticated(
                "the lease API needs a credential: Authorization: Bearer <secret>"
            )
        presented = _digest(m.group(1))
        found = None
        for digest, caller in self._callers:  # every one, whichever matches
            if hmac.compare_digest(digest, presented):
                found = caller
        if found is None:
            raise LeaseUnauthenticated("the lease API does not know this credential")
        return found


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("ascii")).digest()
