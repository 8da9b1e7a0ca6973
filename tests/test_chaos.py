"""The fault-injection run: a short seeded run holds every invariant, the same run
against a build with the fence check off is caught, and the checker itself flags
each kind of violation it is given."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from fenceproxy.chaos import FAULTS, ChaosOptions, run_chaos
from fenceproxy.chaos.checker import check
from fenceproxy.server.app import FenceProxy
from fenceproxy.testing import ProxyTestServer

from .broken_fence import STORES, decide_ignoring_generations
from .postgres import PostgresServer

# The deliberately broken build: fenceproxy with a store that admits stale writes.
BROKEN_PROXY = (sys.executable, str(Path(__file__).with_name("broken_fence.py")))

SHORT = ChaosOptions(duration=20, workers=5, jobs=2, seed=7, faults=frozenset(FAULTS))


def _missing_evidence(c: dict[str, int]) -> list[str]:
    """What a run did not show: the faults happening, the proxy refusing and forwarding."""
    wanted = {
        "a proxy crash": c["crashes"] >= 1,
        "a SIGSTOP pause": c["sigstops"] >= 1,
        "a stall": c["stalls"] >= 1,
        "over 20 writes forwarded": c["forwarded"] > 20,
        "over 5 jobs completed": c["completed"] > 5,
        "a duplicate suppressed": c["duplicates"] >= 1,
        "a stale write refused": c["stale"] >= 1,
        # Each stall costs its lease, and so does a pause of a holder that is not
        # stalled (a pause lasts 1.5 to 3 leases).
        "a lease lost per stall and paused holder": (
            c["leases lost"] >= c["stalls"] + min(c["holders paused"], 1)
        ),
    }
    return [what for what, seen in wanted.items() if not seen]


@pytest.mark.slow
@pytest.mark.timeout(150)
async def test_short_run_with_every_fault_has_no_violation() -> None:
    """No run may show a violation. Whether a fault lands where it shows (a pause on a
    holder, a takeover racing a stalled write) is timing's: a run that shows too little
    is followed by the next seed's, up to three."""
    out = io.StringIO()
    for seed in (SHORT.seed, SHORT.seed + 1, SHORT.seed + 2):
        report = await run_chaos(ChaosOptions(**{**SHORT.__dict__, "seed": seed}), out)
        assert report.violations == [], out.getvalue()
        missing = _missing_evidence(report.counts)
        if not missing:
            return
        out.write(f"not shown: {', '.join(missing)}\n")
    pytest.fail(f"three runs did not show every fault at work:\n{out.getvalue()}")


@pytest.mark.slow
@pytest.mark.timeout(150)
async def test_two_proxies_on_postgres_killed_independently_have_no_violation(
    postgres: PostgresServer,
) -> None:
    """As the run above on two proxies; a run that shows too little (a crash, a stale
    write refused, over 20 writes forwarded: timing's) is followed by the next seed's,
    up to three."""
    out = io.StringIO()
    shared = {"store": postgres.url("fenceproxy"), "proxies": 2}
    for seed in (SHORT.seed, SHORT.seed + 1, SHORT.seed + 2):
        opts = ChaosOptions(**{**SHORT.__dict__, **shared, "seed": seed})
        report = await run_chaos(opts, out)
        assert report.violations == [], out.getvalue()
        assert "2 proxies on PostgreSQL database" in out.getvalue()
        c = report.counts
        if c["crashes"] >= 1 and c["forwarded"] > 20 and c["stale"] >= 1:
            return
    pytest.fail(f"three runs did not show a crash, stale writes and traffic:\n{out.getvalue()}")


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_the_same_run_without_the_fence_check_is_caught() -> None:
    """A stale write needs a takeover to race a paused worker, which timing decides:
    the broken build must be caught within three seeds, and in practice is in one."""
    out = io.StringIO()
    for seed in (SHORT.seed, SHORT.seed + 1, SHORT.seed + 2):
        broken = ChaosOptions(**{**SHORT.__dict__, "seed": seed, "proxy_command": BROKEN_PROXY})
        report = await run_chaos(broken, out)
        if any("applied after generation" in v for v in report.violations):
            return
    pytest.fail(f"no run caught the build without the fence check:\n{out.getvalue()}")


def write(
    op: str, status: int, slug: str = "", replayed: bool = False, **more: Any
) -> dict[str, Any]:
    return {"ev": "write", "op": op, "status": status, "slug": slug, "replayed": replayed, **more}


def applied(seq: int, op: str, generation: int, key: str | None = None) -> dict[str, Any]:
    return {"seq": seq, "op": op, "job": "j", "generation": generation, "key": key}


def granted(ev: str, owner: str, generation: int) -> dict[str, Any]:
    """A claim or a completion of job j that the proxy granted ``owner``."""
    return {"ev": ev, "job": "j", "ok": True, "owner": owner, "generation": generation}


def final_lease(state: str, owner: str, generation: int) -> dict[str, Any]:
    """Job j's lease as the store holds it at the end of the run."""
    return {"j": {"state": state, "owner": owner, "generation": generation}}


def test_checker_passes_a_clean_history() -> None:
    ledger = [applied(1, "a", 1, "k1"), applied(2, "b", 2)]
    events = [
        granted("claim", "w1", 1),
        granted("claim", "w2", 2),
        write("a", 200),
        write("a", 200, replayed=True),
        write("b", 200),
        write("c", 409, "stale-generation"),
        granted("complete", "w2", 2),
    ]
    final = final_lease("completed", "w2", 2)
    assert check(ledger, events, final).violations == []


@pytest.mark.parametrize(
    ("ledger", "events", "final", "expected"),
    [
        pytest.param(
            [applied(1, "b", 2), applied(2, "a", 1)], [], {}, "applied after generation",
            id="generation-goes-down",
        ),
        pytest.param(
            [applied(1, "a", 1, "k"), applied(2, "a", 1, "k")], [], {}, "applied 2 times",
            id="key-twice",
        ),
        pytest.param([], [write("a", 200)], {}, "absent from the ledger", id="lost-2xx"),
        pytest.param(
            [], [write("a", 0, "connection-error"), write("a", 200, replayed=True)], {},
            "absent from the ledger", id="lost-but-replayed",
        ),
        pytest.param([applied(1, "x", 1)], [], {}, "sent by no worker", id="unsent-write"),
        pytest.param(
            [], [granted("claim", "w1", 1), granted("claim", "w2", 1)],
            final_lease("held", "w2", 1), "granted to w2", id="generation-granted-twice",
        ),
        pytest.param(
            [], [granted("claim", "w1", 3)], final_lease("held", "w0", 2),
            "generation 3 was granted", id="final-lease-behind",
        ),
        pytest.param(
            [applied(1, "a", 1)], [write("a", 409, "stale-generation")], {},
            "but applied by the upstream", id="refused-but-applied",
        ),
        pytest.param(
            [], [granted("complete", "w1", 1), granted("complete", "w2", 2)],
            final_lease("completed", "w2", 2), "completed 2 times", id="completed-twice",
        ),
        pytest.param(
            [], [granted("complete", "w1", 1)], final_lease("completed", "w2", 2),
            "highest generation is 2", id="completed-by-stale-holder",
        ),
    ],
)  # fmt: skip
def test_checker_flags_each_violation(
    ledger: list[dict[str, Any]],
    events: list[dict[str, Any]],
    final: dict[str, Any],
    expected: str,
) -> None:
    violations = check(ledger, events, final).violations
    assert any(expected in v for v in violations), violations


def test_unknown_outcomes_are_not_held_against_the_proxy() -> None:
    # A 504 or a dropped connection may or may not have been applied.
    ledger = [applied(1, "a", 1)]
    events = [write("a", 504, "upstream-timeout"), write("b", 502, "upstream-failed")]
    assert check(ledger, events, {}).violations == []


@pytest.mark.parametrize("broken", [False, True], ids=["fenceproxy", "fence-check-off"])
async def test_checker_over_a_directed_stale_write(
    aiohttp_client: Any,
    proxy_config: Any,
    upstream: Any,
    broken: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The mutation check without chance: generation 2 writes, then a stale
    generation-1 write arrives. The real build refuses it and the checker is
    content; the broken build applies it and the checker says so."""
    if broken:
        monkeypatch.setattr(STORES, "decide", decide_ignoring_generations)
    proxy = await aiohttp_client(ProxyTestServer(FenceProxy(proxy_config())))
    events = []
    for op, generation in (("new", 2), ("stale", 1)):
        answer = await proxy.post(
            "/billing/x",
            json={"op": op},
            headers={"Fencing-Job": "j", "Fencing-Token": str(generation)},
        )
        slug = (await answer.json())["type"].rsplit(":", 1)[1] if answer.status >= 400 else ""
        events.append(write(op, answer.status, slug))
    ledger = [
        {"seq": n, "op": json.loads(r.body)["op"], "job": r.job, "generation": r.generation}
        for n, r in enumerate(upstream.received, 1)
    ]
    violations = check(ledger, events, {}).violations
    if broken:
        assert any("applied after generation 2" in v for v in violations), violations
    else:
        assert events[1]["slug"] == "stale-generation"
        assert violations == []
