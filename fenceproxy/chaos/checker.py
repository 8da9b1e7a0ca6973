"""The fault-injection checker: invariants over what the workers were answered
(their histories), what the upstream applied (its ledger) and the lease records
the store ends with. Pure: no I/O.

Checked:

1. per job, the generations in the ledger never go down (so no write of
   generation g reached the upstream after a write of a higher generation);
2. no idempotency key is applied twice;
3. every write the proxy answered 2xx (first or replayed) is in the ledger, and
   every write in the ledger was sent by some worker;
4. every write the proxy refused, in every attempt, is absent from the ledger;
5. no generation of a job was granted twice, and the job's final lease holds the
   highest one granted;
6. each job is completed at most once, and only by the holder of its highest
   generation.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["NOT_APPLIED", "Report", "check"]

# Refusals after which the write cannot have reached the upstream.
NOT_APPLIED = frozenset(
    {
        "stale-generation",
        "job-quarantined",
        "store-unavailable",
        "upstream-unreachable",
        "fencing-header-missing",
        "fencing-header-malformed",
        "idempotency-key-malformed",
        "idempotency-key-reused",
        "idempotency-key-other-caller",
        "body-too-large",
    }
)
_DUPLICATE = frozenset(
    {
        "duplicate-in-flight",
        "duplicate-outcome-unknown",
        "duplicate-rejected",
        "duplicate-not-stored",
    }
)


@dataclass
class Report:
    counts: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)

    def table(self) -> str:
        rows = [
            ("writes sent", "writes sent"),
            ("forwarded and applied (2xx)", "forwarded"),
            ("refused as stale", "stale"),
            ("duplicates suppressed", "duplicates"),
            ("refused while quarantined", "quarantined"),
            ("upstream failures (5xx)", "upstream failures"),
            ("no answer (proxy down)", "no answer"),
            ("writes applied (ledger)", "applied"),
            ("claims granted", "claims"),
            ("jobs completed", "completed"),
            ("leases lost", "leases lost"),
            ("in-process stalls", "stalls"),
            ("SIGSTOP pauses", "sigstops"),
            ("  of a lease's holder", "holders paused"),
            ("proxy crashes survived", "crashes"),
            ("violations", "violations"),
        ]
        self.counts["violations"] = len(self.violations)
        width = max(len(label) for label, _ in rows)
        lines = [f"  {label:<{width}}  {self.counts[key]:>7}" for label, key in rows]
        return "\n".join(lines)


def check(
    ledger: Iterable[Mapping[str, Any]],
    events: Iterable[Mapping[str, Any]],
    leases: Mapping[str, Mapping[str, Any] | None],
) -> Report:
    """Check the invariants; ``leases`` maps each job to its final lease record."""
    report = Report()
    ledger = list(ledger)
    events = list(events)
    c = report.counts
    bad = report.violations
    c["applied"] = len(ledger)

    # 1. Generations per job never go down in the order the upstream applied them.
    highest: dict[str, tuple[int, Any]] = {}
    for entry in ledger:  # in the order the upstream applied them
        job, generation = entry["job"], entry["generation"]
        if job in highest and generation < highest[job][0]:
            bad.append(
                f"job {job}: generation {generation} (op {entry['op']}) applied after "
                f"generation {highest[job][0]} (op {highest[job][1]})"
            )
        if job not in highest or generation >= highest[job][0]:
            highest[job] = (generation, entry["op"])

    # 2. No idempotency key applied twice.
    keys = Counter((e["job"], e["key"]) for e in ledger if e.get("key"))
    for (job, key), times in keys.items():
        if times > 1:
            bad.append(f"job {job}: idempotency key {key} applied {times} times")

    # 3 and 4. What the proxy answered against what the upstream applied.
    applied_ops = {e["op"] for e in ledger}
    attempts: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for event in events:
        if event["ev"] == "write":
            attempts[event["op"]].append(event)
            _count_write(c, event)
    for op, tries in attempts.items():
        answered = any(200 <= t["status"] < 300 for t in tries)  # a replay proves it too
        if answered and op not in applied_ops:
            bad.append(f"op {op}: answered 2xx but absent from the ledger (lost)")
        if all(t["slug"] in NOT_APPLIED for t in tries) and op in applied_ops:
            slugs = ", ".join(sorted({t["slug"] for t in tries}))
            bad.append(f"op {op}: refused ({slugs}) but applied by the upstream")

    for op in applied_ops - attempts.keys():
        bad.append(f"op {op}: applied by the upstream but sent by no worker")

    # 5. Each generation granted once; the final lease holds the highest.
    # 6. Completions: at most one per job, by the holder of its highest generation.
    granted: dict[str, dict[int, str]] = defaultdict(dict)
    completions: dict[str, set[tuple[str, int]]] = defaultdict(set)
    for event in events:
        kind = event["ev"]
        if kind == "claim" and event["ok"]:
            c["claims"] += 1
            job, generation = event["job"], event["generation"]
            if generation in granted[job]:
                bad.append(
                    f"job {job}: generation {generation} granted to {event['owner']} and, "
                    f"before, to {granted[job][generation]}"
                )
            granted[job][generation] = event["owner"]
        elif kind == "complete" and event["ok"]:
            completions[event["job"]].add((event["owner"], event["generation"]))
        elif kind == "lost":
            c["leases lost"] += 1
        elif kind == "stall":
            c["stalls"] += 1
    for job, done in completions.items():
        if len(done) > 1:
            bad.append(f"job {job}: completed {len(done)} times: {sorted(done)}")
        final = leases.get(job)
        if final is None or final.get("state") != "completed":
            bad.append(f"job {job}: completed by {sorted(done)} but its lease reads {final}")
            continue
        for owner, generation in done:
            if (owner, generation) != (final["owner"], final["generation"]):
                bad.append(
                    f"job {job}: completed by {owner} at generation {generation}, but the "
                    f"highest generation is {final['generation']} ({final['owner']})"
                )
    for job, gens in granted.items():
        final = leases.get(job)
        if final is None or final["generation"] < max(gens):
            bad.append(
                f"job {job}: generation {max(gens)} was granted, but its lease reads {final}"
            )
    c["completed"] = sum(1 for r in leases.values() if r and r.get("state") == "completed")
    return report


def _count_write(c: Counter[str], event: Mapping[str, Any]) -> None:
    status, slug = event["status"], event["slug"]
    c["writes sent"] += 1
    if 200 <= status < 300:
        c["duplicates" if event["replayed"] else "forwarded"] += 1
    elif slug == "stale-generation":
        c["stale"] += 1
    elif slug in _DUPLICATE:
        c["duplicates"] += 1
    elif slug == "job-quarantined":
        c["quarantined"] += 1
    elif status >= 500:
        c["upstream failures"] += 1
    elif status == 0:
        c["no answer"] += 1
