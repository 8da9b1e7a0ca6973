"""The ``store:`` value: which backend, where, and its options, parsed once.

Only the store reads these: the config keeps the text and checks it parses."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Literal
from urllib.parse import (
    SplitResult,
    parse_qs,
    parse_qsl,
    quote,
    unquote,
    urlencode,
    urlsplit,
    urlunsplit,
)

__all__ = ["StoreURL", "absolute_store_url", "parse_store_url"]


@dataclass(frozen=True, slots=True)
class StoreURL:
    """A parsed ``store:`` value: a SQLite file, or a PostgreSQL database."""

    backend: Literal["sqlite", "postgresql"]
    path: str = ""
    """SQLite: the file."""
    synchronous: Literal["full", "normal"] = "full"
    dsn: str = ""
    """PostgreSQL: the URL for the driver, without fenceproxy's own options."""
    pool: int = 10
    password_env: str | None = None
    """PostgreSQL: the environment variable that holds the password."""
    hosts: tuple[str, ...] = ()
    """PostgreSQL: each ``host`` or ``host:port`` the URL names, in its order."""
    require_sync: bool = False
    """PostgreSQL: ready only while the primary has a synchronous standby."""

    def describe(self) -> str:
        """Where the store is, for a log line: never a password."""
        if self.backend == "sqlite":
            return f"SQLite file {self.path}"
        return f"PostgreSQL database {','.join(self.hosts)}{urlsplit(self.dsn).path}"


_STORE_FORMS = (
    "expected sqlite:///PATH (relative to the config file's folder), sqlite:////ABSOLUTE/PATH "
    "or postgresql://USER@HOST:PORT/DATABASE"
)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
# One host of a URL's list: a name or an IPv4 address, or an IPv6 one in brackets,
# and an optional port.
_HOST = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[^\[\]:/@,]+)(?::(?P<port>[0-9]{1,5}))?")
# What the store's connections must find: a server that takes writes. Any other
# choice of libpq's would let a decision be made on a standby, which cannot record it.
_SESSION_ATTRS = ("read-write", "primary")
_SSL_MODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
# The driver's options that name files: relative to the config file's folder.
_SSL_FILES = ("sslrootcert", "sslcert", "sslkey", "sslcrl")


def parse_store_url(value: str) -> StoreURL:
    """``sqlite:///relative.db`` or ``sqlite:////absolute.db``, with an optional
    ``?synchronous=full|normal``; or ``postgresql://user@host:port/db`` (also
    ``postgres://``, and several hosts: ``user@h1:5432,h2:5432``) with optional
    ``?pool=N``, ``?password_env=NAME`` and ``?require_sync=true``, other options
    going to the driver: ``target_session_attrs=read-write`` among them unless
    ``primary`` is given, ``application_name=fenceproxy`` unless another is, and
    TLS as libpq takes it (``sslmode=verify-full&sslrootcert=ca.pem``, a client
    certificate with ``sslcert`` and ``sslkey``).
    Raises ValueError, also for a password written into the URL: it belongs in the
    environment."""
    parts = urlsplit(value)
    if parts.scheme in ("postgresql", "postgres"):
        return _parse_postgres_url(parts)
    if parts.scheme != "sqlite" or parts.netloc or len(parts.path) < 2:
        raise ValueError(_STORE_FORMS)
    options = parse_qs(parts.query, keep_blank_values=True)
    synchronous = options.pop("synchronous", ["full"])[-1]
    if options or synchronous not in ("full", "normal"):
        raise ValueError("the only store option is ?synchronous=full or ?synchronous=normal")
    return StoreURL(
        "sqlite", unquote(parts.path[1:]), "full" if synchronous == "full" else "normal"
    )


def _parse_postgres_url(parts: SplitResult) -> StoreURL:
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    if not hostlist or parts.path in ("", "/"):
        raise ValueError(_STORE_FORMS)
    if ":" in userinfo:
        raise ValueError(
            "a password must not be written into the config: name the environment variable "
            "that holds it with ?password_env=NAME (or set PGPASSWORD)"
        )
    hosts = tuple(hostlist.split(","))
    for host in hosts:
        found = _HOST.fullmatch(host)
        if found is None or not 0 < int(found["port"] or 5432) < 65536:
            raise ValueError(
                f"{host!r} is not a host: expected HOST, HOST:PORT or [IPv6]:PORT, "
                "several separated by commas"
            )
    options = parse_qs(parts.query, keep_blank_values=True)
    pool = options.pop("pool", ["10"])[-1]
    if not pool.isdigit() or not 1 <= int(pool) <= 1000:
        raise ValueError("?pool= takes a number of connections from 1 to 1000")
    password_env = options.pop("password_env", [None])[-1]
    if password_env is not None and not _ENV_NAME.fullmatch(password_env):
        raise ValueError("?password_env= takes the name of an environment variable")
    require_sync = options.pop("require_sync", ["false"])[-1]
    if require_sync not in ("true", "false"):
        raise ValueError("?require_sync= takes true or false")
    sslmode = options.get("sslmode", ["prefer"])[-1]
    if sslmode not in _SSL_MODES:
        raise ValueError(f"?sslmode= takes one of {', '.join(_SSL_MODES)}")
    options.setdefault("application_name", ["fenceproxy"])  # in pg_stat_activity
    attrs = options.setdefault("target_session_attrs", ["read-write"])
    if attrs[-1] not in _SESSION_ATTRS:
        raise ValueError(
            "?target_session_attrs= must be read-write or primary: the store decides "
            "only where it can record, on the primary"
        )
    query = urlencode([(k, v) for k, values in options.items() for v in values])
    dsn = urlunsplit(("postgresql", parts.netloc, parts.path, query, ""))
    return StoreURL(
        "postgresql",
        dsn=dsn,
        pool=int(pool),
        password_env=password_env,
        hosts=hosts,
        require_sync=require_sync == "true",
    )


def absolute_store_url(value: str, base: str | os.PathLike[str]) -> str:
    """``value`` with a relative SQLite path made absolute against the folder ``base``,
    so the store is the same whatever the working directory; raises ValueError."""
    parsed = parse_store_url(value)
    if parsed.backend != "sqlite":
        return _absolute_ssl_files(value, base)
    path = parsed.path
    if os.path.isabs(path):
        return value
    query = urlsplit(value).query
    absolute = os.path.abspath(os.path.join(base, path))
    return f"sqlite:///{quote(absolute)}" + (f"?{query}" if query else "")


def _absolute_ssl_files(value: str, base: str | os.PathLike[str]) -> str:
    """A PostgreSQL URL with its relative TLS files (``sslrootcert`` and the like) made
    absolute against the folder ``base``."""
    parts = urlsplit(value)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    if not any(k in _SSL_FILES and not os.path.isabs(v) for k, v in pairs):
        return value
    pairs = [
        (k, os.path.abspath(os.path.join(base, v)) if k in _SSL_FILES else v) for k, v in pairs
    ]
    return urlunsplit(parts._replace(query=urlencode(pairs)))
