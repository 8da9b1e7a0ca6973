"""The worked example users run first (`make demo`) holds its expectations."""

from __future__ import annotations

import io

from fenceproxy.demo import run_demo


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
