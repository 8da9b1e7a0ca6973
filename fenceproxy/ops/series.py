"""What the operator page draws over time (:mod:`fenceproxy.ops.page`): the last hour of
this process, in :data:`STEP`-second buckets, kept in memory.

Each bucket holds the fenced decisions by outcome (``forwarded``, ``replayed``, or the
refusal's problem kind), three histograms of a fenced write's time (through the proxy,
its store part, its upstream part) and the store's commits and the operations they
carried. A histogram is :data:`BINS` counts over fixed bounds, each a cube root of two
above the one before, from 31 µs to 64 s: a percentile read from it is within a bin
(26 %) of the true one, within an eighth when the times spread over several bins; and
the buckets of several processes add up (:meth:`Hour.merged`).

Recording is a few updates per fenced write, no list of requests; what is kept is
bounded (:data:`KEPT` buckets), this process's only, and lost on a restart.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

__all__ = ["BINS", "BOUNDS", "KEPT", "STEP", "Hour", "Series"]

STEP = 10
"""Seconds a bucket spans."""
KEPT = 360
"""Buckets kept: an hour."""
_RATIO = 2 ** (1 / 3)
BOUNDS = tuple(2 ** (k / 3) for k in range(-45, 19))
"""Each bin's upper bound in seconds, 2**-15 (31 µs) to 2**6 (64 s); the last bin is
above them all."""
BINS = len(BOUNDS) + 1
_PARTS = ("total", "store", "upstream")
"""A fenced write's times: through the proxy, in the store, at the upstream."""
_PASSED = frozenset({"forwarded", "replayed"})
_CLASSES = ("forwarded", "replayed", "refused")


class _Bucket:
    """What one :data:`STEP` of the clock saw (``index``: its start over STEP)."""

    __slots__ = ("commits", "decisions", "index", "largest", "operations", *_PARTS)

    def __init__(self, index: int) -> None:
        self.index = index
        self.decisions: dict[str, int] = {}
        self.total = [0] * BINS
        self.store = [0] * BINS
        self.upstream = [0] * BINS
        self.commits = 0
        self.operations = 0
        self.largest = 0

    def add(self, other: _Bucket) -> None:
        for outcome, n in other.decisions.items():
            self.decisions[outcome] = self.decisions.get(outcome, 0) + n
        for part in _PARTS:
            mine = getattr(self, part)
            for i, n in enumerate(getattr(other, part)):
                mine[i] += n
        self.commits += other.commits
        self.operations += other.operations
        self.largest = max(self.largest, other.largest)

    def json(self) -> dict[str, Any]:
        found: dict[str, Any] = {
            "index": self.index,
            "decisions": self.decisions,
            "commits": self.commits,
            "operations": self.operations,
            "largest": self.largest,
        }
        for part in _PARTS:  # sparse: [bin, count] where counted
            found[part] = [[i, n] for i, n in enumerate(getattr(self, part)) if n]
        return found

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> _Bucket:
        bucket = cls(int(data["index"]))
        bucket.decisions = {str(k): int(n) for k, n in data["decisions"].items()}
        for part in _PARTS:
            counts = getattr(bucket, part)
            for i, n in data[part]:
                counts[i] = n
        bucket.commits, bucket.operations = data["commits"], data["operations"]
        bucket.largest = data["largest"]
        return bucket


class Series:
    """The last hour of this process, recorded as it happens, on ``clock`` (wall-clock
    seconds: the buckets are the clock's, so those of several processes line up).
    Only the event loop records, so no lock."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._since = clock()
        self._buckets: deque[_Bucket] = deque(maxlen=KEPT)
        self._last = _Bucket(-1)  # no bucket yet: the first record starts one

    def _now(self) -> _Bucket:
        index = int(self._clock() // STEP)
        if self._last.index != index:
            self._last = _Bucket(index)
            self._buckets.append(self._last)
        return self._last

    def decision(self, outcome: str, seconds: float) -> None:
        """A fenced write decided (its outcome: forwarded, replayed, would-<kind> or the
        refusal's kind), ``seconds`` after its head was read."""
        bucket = self._now()
        bucket.decisions[outcome] = bucket.decisions.get(outcome, 0) + 1
        bucket.total[bisect_left(BOUNDS, seconds)] += 1

    def store(self, seconds: float) -> None:
        """A fenced write's store part: its admission, every ask, and its settlement."""
        self._now().store[bisect_left(BOUNDS, seconds)] += 1

    def upstream(self, seconds: float) -> None:
        """A fenced write's upstream part: from sending it to the upstream's answer."""
        self._now().upstream[bisect_left(BOUNDS, seconds)] += 1

    def batch(self, operations: int) -> None:
        """A store transaction committed with ``operations`` in it."""
        bucket = self._now()
        bucket.commits += 1
        bucket.operations += operations
        bucket.largest = max(bucket.largest, operations)

    def hour(self) -> Hour:
        """What is kept, to be merged or drawn (the buckets are shared, not copied:
        read it at once)."""
        return Hour(self._since, _one_per_index(self._buckets))


@dataclass(frozen=True, slots=True)
class Hour:
    """Buckets of one process or several (``since``: when the first of them started),
    as the page's charts read them (:meth:`drawn`): one bucket per index, in order."""

    since: float
    buckets: list[_Bucket]

    def json(self) -> dict[str, Any]:
        return {"since": self.since, "buckets": [b.json() for b in self.buckets]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Hour:
        buckets = [_Bucket.from_json(b) for b in data["buckets"]]
        return cls(float(data["since"]), _one_per_index(buckets))

    @classmethod
    def merged(cls, hours: Iterable[Hour]) -> Hour:
        """Several processes' hours as one: each bucket's counts added up, its largest
        batch the largest of them."""
        hours = list(hours)
        return cls(min(h.since for h in hours), _summed(b for h in hours for b in h.buckets))

    def drawn(self, now: float) -> dict[str, Any]:
        """The charts' data at ``now``: ``at``, the start of each of the last
        :data:`KEPT` buckets (the one under way last), and for each bucket: ``seen``,
        the seconds of it seen (at least one: the first bucket begins before the
        start, the last is under way; None before ``since``); decisions per second
        over them by outcome (``forwarded``, with what a report-only route let
        through; ``replayed``; ``refused``) and refusals per second by kind; each
        part's p50 and p99 in ``seconds`` and the mean and largest ``batches``, None
        where there were none."""
        current = int(now // STEP)
        indexes = range(current - KEPT + 1, current + 1)
        found = {b.index: b for b in self.buckets}
        empty = _Bucket(-1)
        rows = [found.get(i, empty) for i in indexes]
        seen = [_seen(i * STEP, now, self.since) for i in indexes]
        classes = [_by_class(r.decisions) for r in rows]
        return {
            "step": STEP,
            "at": [i * STEP for i in indexes],
            "seen": seen,
            "decisions": {c: _rates([n[c] for n in classes], seen) for c in _CLASSES},
            "refusals": {
                kind: _rates([r.decisions.get(kind, 0) for r in rows], seen)
                for kind in _refusal_kinds(rows)
            },
            "seconds": {
                part: {
                    "p50": [_percentile(getattr(r, part), 0.5) for r in rows],
                    "p99": [_percentile(getattr(r, part), 0.99) for r in rows],
                }
                for part in _PARTS
            },
            "batches": {
                "mean": [round(r.operations / r.commits, 2) if r.commits else None for r in rows],
                "largest": [r.largest if r.commits else None for r in rows],
            },
        }


def _seen(start: float, now: float, since: float) -> float | None:
    """The seconds of the bucket from ``start`` that were seen, at least one (a rate
    over a bucket just begun would be a guess); None when it ended before ``since``."""
    span = min(start + STEP, now) - max(start, since)
    return None if span <= 0 else round(max(span, 1.0), 3)


def _rates(counts: list[int], seen: list[float | None]) -> list[float | None]:
    """Per second of each bucket seen."""
    return [
        None if span is None else round(n / span, 4) for n, span in zip(counts, seen, strict=True)
    ]


def _one_per_index(buckets: Iterable[_Bucket]) -> list[_Bucket]:
    """``buckets`` as they are when each index comes once, in order, as one process
    records them; summed (:func:`_summed`) where the clock stepped back and an index
    came again."""
    buckets = list(buckets)
    if all(a.index < b.index for a, b in pairwise(buckets)):
        return buckets
    return _summed(buckets)


def _summed(buckets: Iterable[_Bucket]) -> list[_Bucket]:
    """One bucket per index, in order, each the sum of those given (never one of them)."""
    summed: dict[int, _Bucket] = {}
    for bucket in buckets:
        mine = summed.get(bucket.index)
        if mine is None:
            mine = summed[bucket.index] = _Bucket(bucket.index)
        mine.add(bucket)
    return [summed[i] for i in sorted(summed)]


def _by_class(decisions: Mapping[str, int]) -> dict[str, int]:
    """Decisions by class: forwarded (a report-only route's would-be refusals with
    them: they were forwarded), replayed, refused."""
    counts = dict.fromkeys(_CLASSES, 0)
    for outcome, n in decisions.items():
        if outcome in _PASSED:
            counts[outcome] += n
        else:
            counts["forwarded" if outcome.startswith("would-") else "refused"] += n
    return counts


def _refusal_kinds(rows: Iterable[_Bucket]) -> list[str]:
    """The outcomes that are not forwarded nor replayed, most first."""
    counts: dict[str, int] = {}
    for row in rows:
        for outcome, n in row.decisions.items():
            if outcome not in _PASSED:
                counts[outcome] = counts.get(outcome, 0) + n
    return sorted(counts, key=lambda kind: (-counts[kind], kind))


def _percentile(counts: list[int], q: float) -> float | None:
    """The ``q`` quantile of a histogram in seconds, interpolated within its bin on the
    bins' geometric scale; the highest bound for one above them all; None when empty."""
    total = sum(counts)
    if not total:
        return None
    rank, below = q * total, 0
    for i, n in enumerate(counts[:-1]):
        if n and below + n >= rank:
            high = BOUNDS[i]
            low = BOUNDS[i - 1] if i else high / _RATIO
            return round(low * math.pow(_RATIO, (rank - below) / n), 7)
        below += n
    return BOUNDS[-1]  # in the last bin, above every bound
