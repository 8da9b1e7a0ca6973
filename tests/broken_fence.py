"""A deliberately broken fenceproxy whose store admits stale writes, for showing
that the fault run's checker notices a broken fence. It lives with the tests, so
nothing in an install of the product can turn the fence off.

    python tests/broken_fence.py serve -c FILE ...   (the arguments of ``fenceproxy``)
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: the project root is not on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fenceproxy.leases.model as lease_model
from fenceproxy.errors import Refusal
from fenceproxy.fence import fencing
from fenceproxy.fence.fencing import Admit, FencedWrite, KeyRecord, Replay


def decide_ignoring_generations(
    write: FencedWrite, current: int | None, key: KeyRecord | None
) -> Admit | Replay | Refusal:
    """The real decision, told that the job has no generation yet."""
    return fencing.decide(write, None, key)


STORES = lease_model
"""The module whose ``decide`` every store's admission calls (through ``decide_write``),
which the broken build swaps."""


def break_the_fence() -> None:
    """Swap the stores' decision for one that admits stale writes (this process only)."""
    STORES.decide = decide_ignoring_generations  # type: ignore[assignment]
    print("broken_fence: THE FENCE CHECK IS OFF, stale writes are forwarded", file=sys.stderr)


if __name__ == "__main__":
    break_the_fence()
    from fenceproxy.cli import main

    sys.exit(main())
