"""Signed fencing tokens: a job's generation, bound to the job by an HMAC-SHA256
signature, so that a client cannot make up a generation.

A signed token is ASCII, and opaque to workers, who send it back as they got it::

    v1.<key id>.<generation>.<signature>

``key id`` names the key that signed it (1 to 32 of ``A-Z a-z 0-9 _ -``), so keys can
rotate: several keys verify, one signs. ``generation`` is the decimal generation.
``signature`` is the unpadded base64url of HMAC-SHA256 over
``fenceproxy-token-v1 NUL key id NUL job id (UTF-8) NUL generation``: the job is not
in the token, it comes from the request, so a token of one job is refused for any
other. A key is 32 or more random bytes, written as unpadded base64url
(:func:`generate_key`).

Nothing here does I/O: the keys are read by the config loader.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import secrets
from collections.abc import Mapping

from ..errors import TokenRejected
from .fencing import GENERATION_MAX, parse_generation

__all__ = [
    "KEY_BYTES_MIN",
    "KEY_ID",
    "SIGNED_PREFIX",
    "SigningKeys",
    "decode_key",
    "generate_key",
    "read_token",
]

SIGNED_PREFIX = "v1."
KEY_BYTES_MIN = 32
KEY_ID = r"[A-Za-z0-9_-]{1,32}"
"""What a key id may be (a pattern): it sits between the token's dots."""
_TOKEN = re.compile(
    rf"v1\.(?P<kid>{KEY_ID})\.(?P<gen>0|[1-9][0-9]{{0,18}})\.(?P<sig>[A-Za-z0-9_-]{{43}})",
    re.ASCII,
)
_CONTEXT = b"fenceproxy-token-v1"


def generate_key() -> str:
    """A new signing key: 32 random bytes as unpadded base64url."""
    return base64.urlsafe_b64encode(secrets.token_bytes(KEY_BYTES_MIN)).rstrip(b"=").decode()


def decode_key(text: str) -> bytes:
    """A key's bytes from its base64url text; ValueError when it is not one, or short."""
    text = text.strip()
    if not re.fullmatch(r"[A-Za-z0-9_-]+", text, re.ASCII):
        raise ValueError("a signing key is base64url text (fenceproxy keys generate)")
    try:
        key = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise ValueError("a signing key is base64url text (fenceproxy keys generate)") from None
    if len(key) < KEY_BYTES_MIN:
        raise ValueError(f"a signing key needs {KEY_BYTES_MIN} bytes or more, this has {len(key)}")
    return key


class SigningKeys:
    """The keys that verify tokens, by id, and the one that signs new ones."""

    __slots__ = ("_keys", "_sign_with")

    def __init__(self, keys: Mapping[str, bytes], sign_with: str) -> None:
        if sign_with not in keys:
            raise ValueError(f"no key {sign_with!r} to sign with")
        self._keys = dict(keys)
        self._sign_with = sign_with

    def __repr__(self) -> str:  # never the material
        return f"SigningKeys(ids={sorted(self._keys)!r}, sign_with={self._sign_with!r})"

    def sign(self, job: str, generation: int) -> str:
        """The token for ``job`` at ``generation``, signed with the signing key."""
        kid = self._sign_with
        signature = _signature(self._keys[kid], kid, job, generation)
        return f"{SIGNED_PREFIX}{kid}.{generation}.{signature}"

    def verify(self, token: str, job: str, header: str) -> int:
        """The generation of a token signed for ``job`` by one of the keys; else
        TokenRejected, saying why without echoing the token."""
        m = _TOKEN.fullmatch(token)
        if m is None:
            raise TokenRejected(f"{header} is not a well-formed signed token")
        kid, generation = m["kid"], int(m["gen"])
        key = self._keys.get(kid)
        if key is None:
            raise TokenRejected(f"{header} is signed by a key this proxy does not know")
        if generation > GENERATION_MAX or not hmac.compare_digest(
            m["sig"], _signature(key, kid, job, generation)
        ):
            raise TokenRejected(f"{header} is not signed for this job and generation")
        return generation


def read_token(
    value: str, header: str, job: str, keys: SigningKeys | None, *, signed_only: bool
) -> int:
    """The generation a fencing token carries. A signed token is verified wherever
    it is sent (a tampered one is never read as a number); a plain integer is taken
    only where the route does not require signatures."""
    if value.startswith(SIGNED_PREFIX):
        if keys is None:
            raise TokenRejected(f"{header} is signed, and this proxy has no signing keys")
        return keys.verify(value, job, header)
    if signed_only:
        raise TokenRejected(f"this route takes only signed tokens in {header}")
    return parse_generation(value, header)


def _signature(key: bytes, kid: str, job: str, generation: int) -> str:
    message = b"\0".join((_CONTEXT, kid.encode(), job.encode("utf-8"), str(generation).encode()))
    digest = hmac.new(key, message, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
