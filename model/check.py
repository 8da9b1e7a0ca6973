#!/usr/bin/env python3
"""Check fenceproxy's protocol model (model/fenceproxy.pml) with spin.

Each check generates the verifier with ``spin -a``, compiles it with gcc and runs
it. The real protocol must pass every check; every mutant, a deliberate protocol
bug, must fail one, with a counterexample whose story is printed (a replay of its
trail: ``pan -r -S``). Exits 1 if the model fails or a mutant passes, 2 if spin or
gcc is missing.

    python3 model/check.py                  # every check and every mutant
    python3 model/check.py --only mutants   # or: exhaustive, bitstate, a mutant's name
    python3 model/check.py --keep DIR       # keep verifiers and trails in DIR

Needs spin (Debian's ``spin``) and gcc; the standard library only.
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

MODEL = Path(__file__).with_name("fenceproxy.pml")


@dataclass(frozen=True)
class Check:
    name: str
    bounds: dict[str, int]
    bitstate: bool = False
    seconds: int = 0
    """For a bitstate search: stop it after this long (SIGINT, after which pan
    reports what it has visited)."""
    mutant: str | None = None
    what: str = ""
    modes: tuple[str, ...] = ()
    """The model's modes: ORDER_GENERATION, EXTERNAL_LEASES (see its header)."""

    def defines(self) -> list[str]:
        named = [f"-D{k}={v}" for k, v in self.bounds.items()]
        flags = [*self.modes, *([self.mutant] if self.mutant else [])]
        return named + [f"-D{flag}" for flag in flags]


# The bounds every check states. One job throughout; the store's clock is counted
# in ticks (a lease lasts 2, a write's in-flight record 2 plus the slack: see the
# model's header).
SMALL = {"WORKERS": 2, "PROXIES": 1, "KEYS": 1, "MAXGEN": 3, "MAXT": 3, "MAXCRASH": 1}
TWO_PROXIES = {**SMALL, "PROXIES": 2, "MAXT": 2}
MORE_CLAIMS = {**SMALL, "MAXGEN": 4, "MAXT": 2, "MAXCRASH": 0}
SLACK = {**SMALL, "SLACK": 1}
LARGE = {"WORKERS": 3, "PROXIES": 2, "KEYS": 2, "MAXGEN": 4, "MAXT": 4, "MAXCRASH": 2}
# Ordered by generation, a worker has two writers, and the state space grows fast:
# one worker (restarted, so two generations), the clock to 1 exhaustively; more
# under bitstate.
PARALLEL = {"WORKERS": 1, "PROXIES": 1, "KEYS": 1, "MAXGEN": 2, "MAXT": 1, "MAXCRASH": 0}
GENERATION = ("ORDER_GENERATION",)
ELSEWHERE = ("ORDER_GENERATION", "EXTERNAL_LEASES")

CHECKS = [
    Check("exhaustive: one proxy that crashes", SMALL),
    Check("exhaustive: two proxies sharing the store", TWO_PROXIES),
    Check("exhaustive: four claims", MORE_CLAIMS),
    Check("exhaustive: a turn slack of one tick", SLACK),
    Check("bitstate: three workers, two proxies, two keys", LARGE, bitstate=True, seconds=30),
    Check("exhaustive: writes of one holder in parallel", PARALLEL, modes=GENERATION),
    Check(
        "exhaustive: in parallel, generations from a lease service elsewhere",
        PARALLEL,
        modes=ELSEWHERE,
    ),
    Check(
        "bitstate: in parallel, two workers, a crash",
        {**SMALL, "MAXT": 2},
        bitstate=True,
        seconds=30,
        modes=GENERATION,
    ),
]

# What each assertion of the model means, for a reader of a counterexample. A mutant
# counts as caught only by one of these, not by a bound of the model running out.
PROPERTIES = {
    "mgen[i]>=applied": "a write of an older generation reached the upstream after a newer one",
    "mgen[i]>=claimed": "an old holder's write reached the upstream after a newer claim was told",
    "kapplied": "a keyed write was applied twice",
    "buntil[v]<=now": "two workers were told they hold the job at one instant",
    "ng>issued": "a generation was handed out twice",
    "rholder==255": "a job was held with no write in flight",
    "!(checked)": "a lease-checked route admitted a write without a live lease",
    "rlate": "a claim waited for a write admitted after a claim first asked",
}

# Each mutant, a deliberate protocol bug: what it breaks. Each is checked within SMALL,
# but those MUTANT_BOUNDS names.
MUTANTS = {
    "FENCE_AFTER_FORWARD": "the fence is checked and raised after forwarding",
    "CLAIM_NO_RAISE": "a claim does not raise the fence to its generation",
    "CLAIM_IGNORES_WRITES": "a claim does not wait for a write in flight",
    "CLAIM_WAITS_FOR_LATER_WRITES": (
        "a claim that must wait raises no fence: the old holder's later writes keep it out"
    ),
    "EARLY_RELEASE": "the in-flight record is given back once the write is sent",
    "RENEW_NO_GEN_CHECK": "renew checks the owner and not the generation",
    "CRASH_FREES_ALL": "a proxy's crash frees every job (records tied to its session)",
    "CRASH_HOLDS_ALL": "a proxy's restart holds every job, written to or not",
    "KEY_FORGET_ON_TIMEOUT": "an unanswered keyed write forgets its key",
    "NO_SEND_DEADLINE": "a proxy that stalled after the admission sends anyway",
    "CLOSE_NOT_ABORT": "a write cut at its timeout is closed, its body flushed on",
    "HOLD_NO_SLACK": "the in-flight record does not count the turn slack",
    "NO_LEASE_CHECK": "a lease-checked route does not check the lease",
    "GEN_OVERTAKE": (
        "ordered by generation, a newer generation's write overtakes an older one in flight"
    ),
}
# A mutant that SMALL cannot show: the bounds it is checked within, and the modes.
MUTANT_BOUNDS: dict[str, tuple[dict[str, int], tuple[str, ...]]] = {
    "HOLD_NO_SLACK": (SLACK, ()),
    "GEN_OVERTAKE": (PARALLEL, ELSEWHERE),
}


def _mutant(name: str, what: str) -> Check:
    bounds, modes = MUTANT_BOUNDS.get(name, (SMALL, ()))
    return Check(f"mutant {name}", bounds, mutant=name, what=what, modes=modes)


CHECKS += [_mutant(name, what) for name, what in MUTANTS.items()]


@dataclass
class Outcome:
    finished: bool
    """pan ran to a report: its error count, some states, not out of memory."""
    errors: int
    states: int
    seconds: float
    memory_mb: float
    complete: bool
    violated: str
    property: str | None
    """What the violated assertion means, if it is one of :data:`PROPERTIES`."""
    hash_factor: str
    output: str


def verify(check: Check, work: Path) -> Outcome:
    """Generate, compile and run the verifier for ``check`` in ``work``."""
    shutil.copy(MODEL, work / MODEL.name)
    run(["spin", *check.defines(), "-a", MODEL.name], work)
    # Exhaustive checks store whole states: a quarter faster than COLLAPSE's
    # compression, for 1.6x its memory (the largest check: about 1.6 GB).
    # A mutant's counterexample is found in a few thousand states, mostly: unoptimised,
    # it builds in a third of -O1's time (0.4 s against 1), and the fourteen search in
    # 16 s of CPU in all against 22.
    optimise = "-O0" if check.mutant else "-O2"
    cflags = [optimise, "-w", "-DSAFETY", "-DMEMLIM=8192", *check.defines()]
    if check.bitstate:
        cflags.append("-DBITSTATE")
    run(["gcc", *cflags, "-o", "pan", "pan.c"], work)
    args = ["./pan", "-m100000"]
    if check.bitstate:
        args.append("-w32")  # 512 MB of bits
    if check.mutant:
        args.append("-I")  # the shortest counterexample it can find: the clearest story
    started = time.monotonic()
    with subprocess.Popen(
        args, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as pan:
        try:
            out, _ = pan.communicate(timeout=check.seconds or None)
            stopped = False
        except subprocess.TimeoutExpired:
            pan.send_signal(signal.SIGINT)
            out, _ = pan.communicate()
            stopped = True
    seconds = time.monotonic() - started
    killed = pan.returncode < 0 and not stopped
    errors = _find(r"errors: (\d+)", out, "")
    states = int(float(_find(r"([\d.e+]+) states, stored", out, "0")))
    violated = _find(r"assertion violated (.*) \(at depth", out, "").strip()
    return Outcome(
        finished=bool(errors) and states > 0 and "out of memory" not in out and not killed,
        errors=int(errors or 0),
        states=states,
        seconds=seconds,
        memory_mb=float(_find(r"([\d.]+)\s+total actual memory usage", out, "0")),
        complete=not stopped
        and "Search not completed" not in out
        and "max search depth too small" not in out,
        violated=violated,
        property=next((m for e, m in PROPERTIES.items() if e in violated), None),
        hash_factor=_find(r"hash factor: ([\d.]+)", out, ""),
        output=out,
    )


def story(work: Path) -> str:
    """The counterexample's story: the model's printf lines, replayed from its trail."""
    replay = run(["./pan", "-r", "-S"], work, check=False)
    lines = []
    for line in replay.splitlines():
        lines.append(line)
        if "assertion violated" in line:
            break
    return "\n".join(lines)


def run(args: list[str], cwd: Path, *, check: bool = True) -> str:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True)
    if check and done.returncode != 0:
        sys.exit(f"{' '.join(args)} failed:\n{done.stdout}{done.stderr}")
    return done.stdout + done.stderr


def _find(pattern: str, text: str, default: str) -> str:
    match = re.search(pattern, text)
    return match.group(1) if match else default


def selected(only: list[str]) -> list[Check]:
    if not only:
        return CHECKS
    chosen = []
    for check in CHECKS:
        kinds = {check.mutant or "", "mutants" if check.mutant else check.name.split(":")[0]}
        if kinds & set(only):
            chosen.append(check)
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", default=[], metavar="NAME")
    parser.add_argument("--keep", type=Path, metavar="DIR")
    args = parser.parse_args(argv)
    for tool in ("spin", "gcc"):
        if shutil.which(tool) is None:
            print(f"{tool} is not installed (Debian: apt-get install spin gcc)", file=sys.stderr)
            return 2
    checks = selected(args.only)
    if not checks:
        parser.error(f"no check is named {' '.join(args.only)}")
    failed = []
    for check in checks:
        passed, report = check_one(check, args.keep)
        print(report, flush=True)
        if not passed:
            failed.append(check.name)
    if failed:
        print(f"{len(failed)} of {len(checks)} checks failed: {', '.join(failed)}")
        return 1
    print(f"all {len(checks)} checks passed")
    return 0


def check_one(check: Check, keep: Path | None) -> tuple[bool, str]:
    """Run ``check``; whether it went as it must, and what to print of it."""
    with tempfile.TemporaryDirectory(prefix="fenceproxy-model-") as tmp:
        work = Path(tmp)
        if keep:
            work = keep / re.sub(r"\W+", "-", check.name).strip("-")
            work.mkdir(parents=True, exist_ok=True)
        outcome = verify(check, work)
        bounds = " ".join(f"{k}={v}" for k, v in check.bounds.items())
        figures = f"{outcome.states:,} states, {outcome.seconds:.1f} s"
        if not outcome.finished:
            return False, "\n".join(
                [f"FAIL {check.name}: pan did not finish", _indent(outcome.output[-3000:])]
            )
        violated = f"     violated: {outcome.property} (assert {outcome.violated})"
        if check.mutant is not None:
            if not (outcome.errors and outcome.property):
                return False, "\n".join(
                    [
                        f"FAIL {check.name}: {check.what}; NOT caught ({figures})",
                        *([violated] if outcome.errors else []),
                    ]
                )
            return True, "\n".join(
                [
                    f"ok   {check.name}: {check.what}; caught ({figures})",
                    violated,
                    _indent(story(work)),
                ]
            )
        if check.bitstate:
            figures += f", hash factor {outcome.hash_factor}"
            if not outcome.complete:
                figures += f", stopped at its {check.seconds} s limit"
        else:
            figures += f", {outcome.memory_mb:.0f} MB"
        if outcome.errors:
            return False, "\n".join(
                [f"FAIL {check.name} ({bounds}): {figures}", violated, _indent(story(work))]
            )
        if not (outcome.complete or check.bitstate):
            return False, "\n".join(
                [
                    f"FAIL {check.name} ({bounds}): the search did not complete",
                    _indent(outcome.output),
                ]
            )
        return True, f"ok   {check.name} ({bounds}): {figures}"


def _indent(text: str) -> str:
    return "\n".join(f"       {line}" for line in text.splitlines())


if __name__ == "__main__":
    sys.exit(main())
