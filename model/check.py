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

    def defines(self) -> list[str]:
        named = [f"-D{k}={v}" for k, v in self.bounds.items()]
        return named + ([f"-D{self.mutant}"] if self.mutant else [])


# The bounds every check states. One job throughout; the store's clock is counted
# in ticks (a lease lasts 2, a write's in-flight record 2: see the model's header).
SMALL = {"WORKERS": 2, "PROXIES": 1, "KEYS": 1, "MAXGEN": 3, "MAXT": 3, "MAXCRASH": 1}
TWO_PROXIES = {"WORKERS": 2, "PROXIES": 2, "KEYS": 1, "MAXGEN": 3, "MAXT": 2, "MAXCRASH": 1}
LARGE = {"WORKERS": 3, "PROXIES": 2, "KEYS": 2, "MAXGEN": 4, "MAXT": 4, "MAXCRASH": 2}

CHECKS = [
    Check("exhaustive: one proxy that crashes", SMALL),
    Check("exhaustive: two proxies sharing the store", TWO_PROXIES),
    Check("bitstate: three workers, two proxies, two keys", LARGE, bitstate=True, seconds=30),
]

# What each assertion of the model means, for a reader of a counterexample.
PROPERTIES = {
    "mgen[i]>=applied": "a write of an older generation reached the upstream after a newer one",
    "mgen[i]>=claimed": "an old holder's write reached the upstream after a newer claim was told",
    "kapplied": "a keyed write was applied twice",
    "buntil[v]<=now": "two workers were told they hold the job at one instant",
    "rholder!=255": "a job was held with no write in flight",
    "ng>issued": "a generation was handed out twice",
}

MUTANTS = {
    "FENCE_AFTER_FORWARD": "the fence is checked and raised after forwarding, not before",
    "CLAIM_NO_RAISE": "a claim does not raise the fence to its generation",
    "CLAIM_IGNORES_WRITES": "a claim does not wait for a write in flight",
    "EARLY_RELEASE": "the in-flight record is given back once the write is sent, not answered",
    "RENEW_NO_GEN_CHECK": "renew checks the owner and not the generation",
    "CRASH_FREES_ALL": "a proxy's crash frees every job (records tied to its session)",
    "CRASH_HOLDS_ALL": "a proxy's restart holds every job, written to or not",
    "KEY_FORGET_ON_TIMEOUT": "an unanswered keyed write forgets its key instead of marking it",
    "NO_SEND_DEADLINE": "a proxy that stalled after the admission sends the write anyway",
}
CHECKS += [Check(f"mutant {name}", SMALL, mutant=name, what=what) for name, what in MUTANTS.items()]


@dataclass
class Outcome:
    errors: int
    states: int
    seconds: float
    memory_mb: float
    complete: bool
    violated: str
    hash_factor: str
    output: str


def verify(check: Check, work: Path) -> Outcome:
    """Generate, compile and run the verifier for ``check`` in ``work``."""
    shutil.copy(MODEL, work / MODEL.name)
    run(["spin", *check.defines(), "-a", MODEL.name], work)
    cflags = ["-O2", "-w", "-DSAFETY", "-DMEMLIM=4096", *check.defines()]
    cflags.append("-DBITSTATE" if check.bitstate else "-DCOLLAPSE")
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
    errors = int(_find(r"errors: (\d+)", out, "0"))
    return Outcome(
        errors=errors,
        states=int(float(_find(r"([\d.e+]+) states, stored", out, "0"))),
        seconds=seconds,
        memory_mb=float(_find(r"([\d.]+)\s+total actual memory usage", out, "0")),
        complete=not stopped
        and "Search not completed" not in out
        and "max search depth too small" not in out,
        violated=_meaning(_find(r"assertion violated (.*) \(at depth", out, "")),
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
        if check.mutant is not None:
            if not outcome.errors:
                return False, f"FAIL {check.name}: {check.what}; NOT caught ({figures})"
            return True, "\n".join(
                [
                    f"ok   {check.name}: {check.what}; caught ({figures})",
                    f"     violated: {outcome.violated}",
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
                [
                    f"FAIL {check.name} ({bounds}): {figures}",
                    f"     violated: {outcome.violated}",
                    _indent(story(work)),
                ]
            )
        if not (outcome.complete or check.bitstate):
            return False, "\n".join(
                [
                    f"FAIL {check.name} ({bounds}): the search did not complete",
                    _indent(outcome.output),
                ]
            )
        return True, f"ok   {check.name} ({bounds}): {figures}"


def _meaning(assertion: str) -> str:
    for expression, meaning in PROPERTIES.items():
        if expression in assertion:
            return f"{meaning} (assert {assertion.strip()})"
    return assertion


def _indent(text: str) -> str:
    return "\n".join(f"       {line}" for line in text.splitlines())


if __name__ == "__main__":
    sys.exit(main())
