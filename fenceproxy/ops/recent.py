"""What this proxy decided lately, kept in memory for the operator page
(:mod:`fenceproxy.ops.page`): the last fenced decisions and lease calls, each numbered so
a page can ask for those after the last it has, and the refusals counted by kind per
minute over the last quarter of an hour.

Bounded (:data:`KEPT` events, :data:`MINUTES` minutes) and this process's only: the
store keeps the fence, the leases and the keys, never this history.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["KEPT", "MINUTES", "Event", "Recent"]

KEPT = 2000
"""Events kept, newest last; the oldest go first."""
MINUTES = 15
"""Minutes of refusal counts kept."""

_GRANTED = frozenset({"forwarded", "replayed", "granted"})


@dataclass(slots=True)
class Event:
    """A fenced write's decision (``action`` ``write``) or a lease call (``claim``,
    ``renew``, ``complete``, ``release``). Values come validated, never a token, a
    header's raw value or a body."""

    seq: int
    at: float
    """Wall-clock time of this proxy when decided."""
    action: str
    job: str | None
    outcome: str
    """``forwarded``, ``replayed`` or ``granted``, or the problem kind of the refusal."""
    status: int
    generation: int | None = None
    """The generation a write sent, or the lease's after a call."""
    current_generation: int | None = None
    """The newer generation that refused a write, when that is why."""
    route: str | None = None
    key: str | None = None
    owner: str | None = None
    ms: float | None = None

    @property
    def refused(self) -> bool:
        return self.outcome not in _GRANTED

    def json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


class Recent:
    """The last :data:`KEPT` events and the refusals by kind per minute."""

    def __init__(self, clock: Any = time.time) -> None:
        self._clock = clock
        self._events: deque[Event] = deque(maxlen=KEPT)
        self._minutes: deque[tuple[int, Counter[str]]] = deque(maxlen=MINUTES)
        self.last = 0
        """The number of the newest event; 0 before the first."""

    def write(
        self,
        route: str,
        job: str | None,
        generation: int | None,
        current_generation: int | None,
        key: str | None,
        outcome: str,
        status: int,
        ms: float,
    ) -> Event:
        """Keep a fenced write's decision."""
        return self._keep(
            Event(
                self.last + 1,
                self._clock(),
                "write",
                job,
                outcome,
                status,
                generation,
                current_generation=current_generation,
                route=route,
                key=key,
                ms=ms,
            )
        )

    def lease(
        self,
        action: str,
        job: str,
        owner: str | None,
        generation: int | None,
        outcome: str = "granted",
        status: int = 200,
        current_generation: int | None = None,
    ) -> Event:
        """Keep a lease call's result."""
        seq = self.last + 1
        return self._keep(
            Event(
                seq,
                self._clock(),
                action,
                job,
                outcome,
                status,
                generation,
                current_generation=current_generation,
                owner=owner,
            )
        )

    def _keep(self, event: Event) -> Event:
        self.last = event.seq
        self._events.append(event)
        if event.refused:
            minute = int(event.at // 60)
            if not self._minutes or self._minutes[-1][0] != minute:
                self._minutes.append((minute, Counter()))
            self._minutes[-1][1][event.outcome] += 1
        return event

    def after(self, seq: int, job: str | None = None, limit: int = KEPT) -> list[Event]:
        """The kept events numbered after ``seq`` (of ``job`` only, when given),
        oldest first, at most the newest ``limit`` of them."""
        found = [e for e in self._newer(seq) if job is None or e.job == job]
        found.reverse()
        return found[-limit:] if limit else []

    def _newer(self, seq: int) -> Iterator[Event]:
        for event in reversed(self._events):
            if event.seq <= seq:
                return
            yield event

    def refusals(self, spans: tuple[int, ...] = (1, 5, MINUTES)) -> dict[str, list[int]]:
        """Refusals by kind over the last minute, 5 minutes and quarter of an hour
        (the minute under way included): ``{kind: [n1, n5, n15]}``, most first."""
        now = int(self._clock() // 60)
        counts: dict[str, list[int]] = {}
        for minute, kinds in self._minutes:
            age = now - minute
            for kind, n in kinds.items():
                row = counts.setdefault(kind, [0] * len(spans))
                for i, span in enumerate(spans):
                    if age < span:
                        row[i] += n
        return dict(
            sorted(
                ((k, v) for k, v in counts.items() if any(v)),
                key=lambda item: (-item[1][-1], item[0]),
            )
        )
