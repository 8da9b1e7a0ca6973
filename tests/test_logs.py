"""Decision logs from a real proxy process: one line per fenced decision, in JSON or
text, with the route, job, generations, key, decision, status, replay and duration;
refusals at INFO (once, not also as a generic refusal), forwarded and replayed writes
at DEBUG; levels set per logger; no token, body or secret in any line."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from fenceproxy.config import parse_config
from fenceproxy.errors import ConfigError
from fenceproxy.log import configure_logging
from fenceproxy.testing import ProxyProcess, RecordingUpstream, eventually, free_port

BODY = {"note": "body-marker-7d1f"}


def config_file(tmp_path: Path, upstream: RecordingUpstream, **top: Any) -> Path:
    path = tmp_path / "proxy.yaml"
    config = {
        "store": f"sqlite:///{tmp_path / 'fences.db'}",
        "routes": [{"name": "billing", "path": "/billing/", "upstream": upstream.url}],
        **top,
    }
    path.write_text(yaml.safe_dump(config))
    return path


async def write(
    session: aiohttp.ClientSession, proxy: ProxyProcess, generation: int, key: str | None = None
) -> int:
    headers = {"Fencing-Job": "invoice-9", "Fencing-Token": str(generation)}
    if key is not None:
        headers["Idempotency-Key"] = key
    async with session.post(f"{proxy.url}/billing/x", json=BODY, headers=headers) as response:
        return response.status


async def test_every_decision_is_one_json_line_with_its_fields(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    config = config_file(
        tmp_path, upstream, log_format="json", log_levels={"fenceproxy.decisions": "debug"}
    )
    proxy = await ProxyProcess(config, free_port()).start()
    try:
        async with aiohttp.ClientSession() as session:
            assert await write(session, proxy, 5, key="k-1") == 200
            assert await write(session, proxy, 5, key="k-1") == 200  # replayed
            assert await write(session, proxy, 4) == 409  # stale
        await eventually(lambda: proxy.output().count('"fenceproxy.decisions"') >= 3)
        output = proxy.output()
    finally:
        await proxy.stop()
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    assert len(lines) == len(output.splitlines())  # every line is JSON
    decisions = [line for line in lines if line["logger"] == "fenceproxy.decisions"]
    forwarded, replayed, stale = decisions
    assert forwarded["decision"] == "forwarded"
    assert forwarded["level"] == "DEBUG"
    assert (forwarded["route"], forwarded["job"], forwarded["generation"]) == (
        "billing",
        "invoice-9",
        5,
    )
    assert (forwarded["key"], forwarded["status"], forwarded["replayed"]) == ("k-1", 200, False)
    assert forwarded["ms"] > 0
    assert forwarded["time"].endswith("+00:00")
    assert (replayed["decision"], replayed["replayed"]) == ("replayed", True)
    assert stale["decision"] == "stale-generation"
    assert stale["level"] == "INFO"
    assert (stale["generation"], stale["current_generation"], stale["status"]) == (4, 5, 409)
    assert not any(line["message"].startswith("refused POST") for line in lines)  # once
    assert "body-marker" not in output


async def test_by_default_a_text_line_tells_of_each_refusal_and_none_of_forwarded_writes(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    proxy = await ProxyProcess(config_file(tmp_path, upstream), free_port()).start()
    try:
        async with aiohttp.ClientSession() as session:
            assert await write(session, proxy, 5) == 200
            assert await write(session, proxy, 4) == 409
        await eventually(lambda: "stale-generation" in proxy.output())
        output = proxy.output()
    finally:
        await proxy.stop()
    (line,) = [line for line in output.splitlines() if "fenceproxy.decisions" in line]
    assert " INFO fenceproxy.decisions stale-generation route=billing job=invoice-9" in line
    assert "generation=4 current_generation=5 key=- decision=stale-generation" in line
    assert "status=409 replayed=false ms=" in line
    assert "forwarded" not in output
    assert "refused POST" not in output  # the decision line is the one line


def test_log_settings_are_validated() -> None:
    routes = [{"name": "b", "path": "/b/", "upstream": "http://127.0.0.1:9"}]
    config = parse_config({"routes": routes, "log_levels": {"aiohttp.access": "warning"}}, "f")
    assert config.log_levels == {"aiohttp.access": "WARNING"}
    with pytest.raises(ConfigError, match=r"log_levels\.aiohttp\.access"):
        parse_config({"routes": routes, "log_levels": {"aiohttp.access": "loud"}}, "f")
    with pytest.raises(ConfigError, match="log_format"):
        parse_config({"routes": routes, "log_format": "xml"}, "f")


def test_a_reload_that_drops_a_level_gives_the_logger_its_level_back() -> None:
    root, store = logging.getLogger(), logging.getLogger("fenceproxy.store")
    before = root.level, store.level
    root.setLevel(logging.WARNING)  # as --log-level set it
    try:
        configure_logging("text", {"root": "DEBUG", "fenceproxy.store": "ERROR"})
        assert (root.level, store.level) == (logging.DEBUG, logging.ERROR)
        configure_logging("text", {"fenceproxy.store": "INFO"})
        assert (root.level, store.level) == (logging.WARNING, logging.INFO)
        configure_logging("text", {})
        assert (root.level, store.level) == (logging.WARNING, logging.NOTSET)
    finally:
        root.setLevel(before[0])
        store.setLevel(before[1])
