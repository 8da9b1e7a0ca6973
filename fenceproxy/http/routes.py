"""Validated route specs compiled once into what a request needs: the longest
matching path, the job id from the path, the fencing headers as ``istr``. A spec is
read through :class:`RouteSource`, what this layer needs of an entry of the config's
``routes:``; the config itself is never imported here.

Routes are matched against the canonical path (:mod:`fenceproxy.http.target`), decoded,
at segment boundaries: ``/billing`` matches ``/billing`` and ``/billing/...``, never
``/billingXYZ``; ``/billing/`` matches ``/billing/...`` only. Decoded, because an
upstream reads ``/a%3Ab`` and ``/a:b`` alike; the canonical path holds no ``%2F``, so
decoding cannot make a separator. Case-sensitively unless the route says otherwise
(``match_case: false``, for upstreams that route case-insensitively)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from multidict import istr
from yarl import URL

from ..errors import NoRoute, RequestTargetNotCanonical
from ..fence.write import Fence
from ..tls import ClientTLS
from .target import PathMode, RequestPath, decode_path

__all__ = ["FenceSource", "Route", "RouteSource", "Router", "TlsSource"]


class FenceSource(Protocol):
    """What a route's ``fence:`` says (the config's ``FenceSpec``)."""

    @property
    def methods(self) -> Iterable[str] | None: ...
    @property
    def job_header(self) -> str: ...
    @property
    def token_header(self) -> str: ...
    @property
    def key_header(self) -> str: ...
    @property
    def scope_headers(self) -> Iterable[str]: ...
    @property
    def on_duplicate(self) -> str: ...
    @property
    def tokens(self) -> str: ...
    @property
    def check_lease(self) -> bool: ...
    @property
    def mode(self) -> str: ...
    @property
    def order(self) -> str: ...


class TlsSource(Protocol):
    """How a route speaks TLS to its upstream (the config's ``UpstreamTlsSpec``)."""

    def client(self) -> ClientTLS: ...


class RouteSource(Protocol):
    """An entry of the config's ``routes:`` (``fenceproxy.config.RouteSpec``), validated,
    as a route is compiled from it."""

    @property
    def name(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def upstream(self) -> str: ...
    @property
    def fence(self) -> FenceSource | None: ...
    @property
    def timeout(self) -> float: ...
    @property
    def connect_timeout(self) -> float: ...
    @property
    def quarantine(self) -> float: ...
    @property
    def max_body(self) -> int: ...
    @property
    def match_case(self) -> bool: ...
    @property
    def paths(self) -> PathMode: ...
    @property
    def host(self) -> str: ...
    @property
    def tls(self) -> TlsSource | None: ...


@dataclass(frozen=True, slots=True)
class Route:
    name: str
    path: str
    upstream: URL
    """Scheme, host and port of the upstream."""
    base_path: str
    """The upstream's base path, to which the request's path is appended."""
    fence: Fence | None
    timeout: float
    connect_timeout: float
    quarantine: float
    max_body: int
    paths: PathMode
    """What a path that is not canonical gets (:mod:`fenceproxy.http.target`)."""
    preserve_host: bool
    """The upstream receives the client's ``Host``, not its own authority."""
    tls: ClientTLS | None
    """How an ``https://`` upstream is spoken to, beyond the system's CAs."""
    _prefix: str | None
    """The decoded route path, when a plain case-sensitive prefix test will do."""
    _pattern: re.Pattern[str] | None

    @classmethod
    def compile(cls, spec: RouteSource) -> Route:
        url = URL(spec.upstream)
        fence = None
        job_in_path = "{job}" in spec.path
        if spec.fence is not None:
            methods = spec.fence.methods
            fence = Fence(
                methods=None if methods is None else frozenset(methods),
                job_in_path=job_in_path,
                job_header=istr(spec.fence.job_header),
                token_header=istr(spec.fence.token_header),
                key_header=istr(spec.fence.key_header),
                scope_headers=tuple(istr(name) for name in spec.fence.scope_headers),
                fields=frozenset(
                    name.lower()
                    for name in (
                        spec.fence.job_header,
                        spec.fence.token_header,
                        spec.fence.key_header,
                    )
                ),
                replay=spec.fence.on_duplicate == "replay",
                signed_only=spec.fence.tokens == "signed",
                check_lease=spec.fence.check_lease,
                report=spec.fence.mode == "report",
                by_generation=spec.fence.order == "generation",
            )
        pattern = None
        if job_in_path or not spec.match_case:
            head, _, tail = spec.path.partition("{job}")
            pattern = re.compile(
                re.escape(head)
                + ("(?P<job>[^/]+)" + re.escape(tail) if job_in_path else "")
                + ("" if spec.path.endswith("/") else "(?=/|$)"),
                0 if spec.match_case else re.IGNORECASE,
            )
        return cls(
            name=spec.name,
            path=spec.path,
            upstream=url.origin(),
            base_path=url.raw_path.rstrip("/"),
            fence=fence,
            timeout=spec.timeout,
            connect_timeout=spec.connect_timeout,
            quarantine=spec.quarantine,
            max_body=spec.max_body,
            paths=spec.paths,
            preserve_host=spec.host == "preserve",
            tls=None if spec.tls is None else spec.tls.client(),
            _prefix=None if pattern is not None else spec.path,
            _pattern=pattern,
        )

    def match(self, decoded: str) -> tuple[bool, str | None]:
        """Whether the decoded canonical path is under this route, and the job id from
        the path when the route has ``{job}``."""
        prefix = self._prefix
        if prefix is not None:
            inside = decoded.startswith(prefix) and (
                prefix.endswith("/") or len(decoded) == len(prefix) or decoded[len(prefix)] == "/"
            )
            return inside, None
        assert self._pattern is not None
        m = self._pattern.match(decoded)
        if m is None:
            return False, None
        return True, m.groupdict().get("job")


class Router:
    """The longest matching route path wins; a path no route matches has no route."""

    __slots__ = ("_routes",)

    def __init__(self, specs: Iterable[RouteSource]) -> None:
        routes = [Route.compile(spec) for spec in specs]
        self._routes = tuple(sorted(routes, key=lambda r: len(r.path), reverse=True))

    def __iter__(self) -> Iterator[Route]:
        return iter(self._routes)

    def match(self, path: str) -> tuple[Route, str | None] | None:
        """The route for a canonical path, and its job id from the path if any."""
        return self._match(decode_path(path) if "%" in path else path)

    def _match(self, decoded: str) -> tuple[Route, str | None] | None:
        for route in self._routes:
            matched, job = route.match(decoded)
            if matched:
                return route, job
        return None

    def route(self, path: RequestPath) -> tuple[Route, str | None, str]:
        """The route for a request's path (no query) read by
        :func:`~fenceproxy.http.target.read_path`, its job id from the path if
        any, and the path to route, fingerprint and forward, as the route's ``paths``
        says (:mod:`fenceproxy.http.target`): found on the canonical form; ``refuse``
        takes a path only if it is canonical but for the spelling of escapes,
        ``normalize`` takes the canonical form, ``exact`` the raw one if it matches
        the same route. A path with no canonical form is taken only by the ``exact``
        route its raw bytes match.

        Raises RequestTargetMalformed for what no route takes as a path,
        RequestTargetNotCanonical for a ``refuse`` route's path that is not canonical
        (its ``canonical`` member says what would be taken) or an ``exact`` route's
        whose raw path falls under another route, NoRoute when no route matches."""
        raw = path.raw
        if path.canonical is None:
            # No canonical form: only an exact route may take it, as sent.
            exact = self._as_sent(path)
            if exact is None or exact[0].paths != "exact":
                assert path.not_canonical is not None
                raise path.not_canonical
            return exact[0], exact[1], raw
        matched = self.match(path.canonical)
        if matched is None:
            raise NoRoute(f"no route is configured for {path.canonical!r}")
        route, job = matched
        if route.paths == "normalize" or path.canonical == raw:
            return route, job, path.canonical
        if route.paths == "refuse":
            if path.escaped != path.canonical:
                raise RequestTargetNotCanonical(
                    f"route {route.name!r} takes a path only in its canonical form, "
                    f"without '.', '..' or empty segments: send {path.canonical!r}",
                    canonical=path.canonical,
                    route=route.name,
                )
            return route, job, path.canonical
        exact = self._as_sent(path)
        if exact is None or exact[0] is not route:
            raise RequestTargetNotCanonical(
                f"the path as sent is not under route {route.name!r}, which its canonical "
                f"form {path.canonical!r} is under: a route forwards only paths it owns both ways",
                canonical=path.canonical,
                route=route.name,
            )
        return route, exact[1], raw

    def _as_sent(self, path: RequestPath) -> tuple[Route, str | None] | None:
        """The route the path as sent matches, decoded as an exact route reads it, if
        any; raises why it may not be taken as sent."""
        if path.exact is None:
            assert path.not_exact is not None
            raise path.not_exact
        return self._match(path.exact)
