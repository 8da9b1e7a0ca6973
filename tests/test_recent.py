"""What the operator page reads: the last decisions, numbered and bounded, and the
refusals by kind per minute, on a clock the test moves."""

from __future__ import annotations

from fenceproxy.ops.recent import KEPT, MINUTES, Recent


class Clock:
    def __init__(self) -> None:
        self.now = 6_000_000.0  # on a minute's boundary

    def __call__(self) -> float:
        return self.now


def refuse(recent: Recent, kind: str, job: str = "j") -> None:
    recent.write("billing", job, 1, 2, None, kind, 409, 0.5)


def test_events_are_numbered_and_read_after_a_number_by_job() -> None:
    recent = Recent(Clock())
    assert (recent.last, recent.after(0)) == (0, [])
    recent.lease("claim", "a", "w1", 1)
    recent.write("billing", "a", 1, None, "k", "forwarded", 200, 1.0)
    refuse(recent, "stale-generation", job="b")
    assert recent.last == 3
    assert [e.seq for e in recent.after(0)] == [1, 2, 3]
    assert [e.seq for e in recent.after(1)] == [2, 3]
    assert [e.action for e in recent.after(0, job="a")] == ["claim", "write"]
    assert [e.seq for e in recent.after(0, limit=2)] == [2, 3]
    assert recent.after(3) == []
    claim = recent.after(0)[0].json()
    assert (claim["owner"], claim["generation"], claim["outcome"]) == ("w1", 1, "granted")


def test_only_the_last_events_are_kept() -> None:
    recent = Recent(Clock())
    for _ in range(KEPT + 5):
        refuse(recent, "stale-generation")
    kept = recent.after(0)
    assert (len(kept), kept[0].seq, kept[-1].seq) == (KEPT, 6, KEPT + 5)


def test_refusals_are_counted_by_kind_over_1_5_and_15_minutes() -> None:
    clock = Clock()
    recent = Recent(clock)
    recent.write("billing", "j", 1, None, None, "forwarded", 200, 1.0)  # not a refusal
    refuse(recent, "stale-generation")
    clock.now += 3 * 60
    refuse(recent, "stale-generation")
    refuse(recent, "job-quarantined")
    clock.now += 60
    refuse(recent, "job-quarantined")
    refuse(recent, "job-quarantined")
    assert recent.refusals() == {"job-quarantined": [2, 3, 3], "stale-generation": [0, 2, 2]}
    clock.now += 10 * 60
    assert recent.refusals() == {"job-quarantined": [0, 0, 3], "stale-generation": [0, 0, 2]}
    clock.now += 60  # the first minute is 15 minutes old now
    assert recent.refusals() == {"job-quarantined": [0, 0, 3], "stale-generation": [0, 0, 1]}
    clock.now += MINUTES * 60
    assert recent.refusals() == {}
