"""The worked example users run first (`make demo`) holds its expectations, and leaves
the ``fenceproxy`` command the documentation goes on with."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from fenceproxy import __version__
from fenceproxy.demo import run_demo

ROOT = Path(__file__).resolve().parent.parent


async def test_demo_runs_the_worked_example_and_passes() -> None:
    out = io.StringIO()
    assert await run_demo(out, ttl=0.3) == 0
    text = out.getvalue()
    assert "renews -> 409 lease-superseded" in text
    assert "sends its late write (generation 1) -> 409" in text
    assert "completes -> 409" in text
    assert "1. generation 1" in text
    assert "2. generation 2" in text
    assert "3. generation" not in text
    assert "FAILED" not in text
    assert "all expectations held" in text


def clone(to: Path) -> Path:
    """The checkout's files, as a fresh clone of it holds them (what git tracks, and
    what it would track, as they are now); no venv."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():  # a file deleted but not yet committed is listed too
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, to / name)
    return to


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_make_demo_leaves_the_fenceproxy_command_in_the_venv(tmp_path: Path) -> None:
    """``make demo`` on a fresh clone runs the worked example and leaves
    ``.venv/bin/fenceproxy``, running the clone's code, which docs/running.md and the
    README's quick start go on with; run again, it installs nothing."""
    checkout = clone(tmp_path / "clone")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as a user's shell
    demo = subprocess.run(
        ["make", "demo"], cwd=checkout, env=env, capture_output=True, text=True, timeout=500
    )
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    assert demo.stdout.rstrip().endswith("all expectations held")
    command = checkout / ".venv" / "bin" / "fenceproxy"
    version = subprocess.run([command, "--version"], env=env, capture_output=True, text=True)
    assert version.stdout == f"fenceproxy {__version__}\n", version.stderr
    python = checkout / ".venv" / "bin" / "python"
    where = subprocess.run(
        [python, "-c", "import fenceproxy; print(fenceproxy.__file__)"],
        env=env, capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert where.stdout == f"{checkout / 'fenceproxy' / '__init__.py'}\n", where.stderr
    up_to_date = subprocess.run(["make", "-q", ".venv/.demo-installed"], cwd=checkout, env=env)
    assert up_to_date.returncode == 0  # the next `make demo` only runs it
