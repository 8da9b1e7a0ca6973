"""Validated route specs compiled once into what a request needs: the longest
matching prefix, the job id from the path, the fencing headers as ``istr``."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from urllib.parse import quote, unquote

from multidict import istr
from yarl import URL

from .config import RouteSpec

__all__ = ["Fence", "Route", "Router"]

_PATH_SAFE = "/:@!$&'()*+,;=-._~"


@dataclass(frozen=True, slots=True)
class Fence:
    """How a route fences its writes. ``job_header`` is None when the job is in the path."""

    methods: frozenset[str]
    job_header: istr | None
    token_header: istr
    key_header: istr
    replay: bool


@dataclass(frozen=True, slots=True)
class Route:
    name: str
    path: str
    upstream: URL
    """Scheme, host and port of the upstream."""
    target: str
    """The upstream's origin and base path, to which the request's path is appended."""
    fence: Fence | None
    timeout: float
    connect_timeout: float
    quarantine: float
    max_body: int
    _prefix: str
    _pattern: re.Pattern[str] | None

    @classmethod
    def compile(cls, spec: RouteSpec) -> Route:
        url = URL(spec.upstream)
        fence = None
        job_in_path = "{job}" in spec.path
        if spec.fence is not None:
            fence = Fence(
                methods=frozenset(spec.fence.methods),
                job_header=None if job_in_path else istr(spec.fence.job_header),
                token_header=istr(spec.fence.token_header),
                key_header=istr(spec.fence.key_header),
                replay=spec.fence.on_duplicate == "replay",
            )
        pattern = None
        if job_in_path:
            head, _, tail = spec.path.partition("{job}")
            pattern = re.compile(
                re.escape(quote(head, safe=_PATH_SAFE))
                + "(?P<job>[^/]+)"
                + re.escape(quote(tail, safe=_PATH_SAFE))
            )
        return cls(
            name=spec.name,
            path=spec.path,
            upstream=url.origin(),
            target=str(url.origin()) + url.raw_path.rstrip("/"),
            fence=fence,
            timeout=spec.timeout,
            connect_timeout=spec.connect_timeout,
            quarantine=spec.quarantine,
            max_body=spec.max_body,
            _prefix=quote(spec.path, safe=_PATH_SAFE),
            _pattern=pattern,
        )

    def match(self, raw_path: str) -> tuple[bool, str | None]:
        """Whether ``raw_path`` (still percent-encoded) is under this route, and the
        job id from the path when the route has ``{job}``."""
        if self._pattern is None:
            return raw_path.startswith(self._prefix), None
        m = self._pattern.match(raw_path)
        if m is None:
            return False, None
        return True, unquote(m.group("job"), errors="surrogateescape")


class Router:
    """The longest matching route path wins; a path no route matches has no route."""

    __slots__ = ("_routes", "longest_quarantine")

    def __init__(self, specs: Iterable[RouteSpec]) -> None:
        routes = [Route.compile(spec) for spec in specs]
        self._routes = tuple(sorted(routes, key=lambda r: len(r.path), reverse=True))
        self.longest_quarantine = max((r.quarantine for r in routes if r.fence), default=0.0)

    def __iter__(self) -> Iterator[Route]:
        return iter(self._routes)

    def match(self, raw_path: str) -> tuple[Route, str | None] | None:
        for route in self._routes:
            matched, job = route.match(raw_path)
            if matched:
                return route, job
        return None
