"""The command line as a person meets it: durations with units, each command's own
usage on its own mistakes, a URL without a scheme refused as a usage error, help
without markup, and a fenced job without a lease shown with its fence."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from fenceproxy import cli
from fenceproxy.run_cli import USAGE

from .conftest import ProxyFactory, fenced

Client = TestClient[Any, Any]


@pytest.fixture
async def proxy(start_proxy: ProxyFactory) -> Client:
    return await start_proxy(leases={})


async def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = await asyncio.to_thread(cli.main, list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exited:
        cli.main(list(argv))
    assert exited.value.code == 2
    return capsys.readouterr().err


async def test_a_ttl_takes_the_units_the_config_takes(
    proxy: Client, capsys: pytest.CaptureFixture[str]
) -> None:
    url = str(proxy.make_url("")).rstrip("/")
    code, out, _ = await run(capsys, "lease", "claim", "j", "--owner", "w", "--ttl", "1500ms",
                             "--url", url)  # fmt: skip
    assert (code, json.loads(out)["ttl"]) == (0, 1.5)
    code, out, _ = await run(capsys, "lease", "renew", "j", "--owner", "w", "--generation", "1",
                             "--ttl", "2m", "--url", url)  # fmt: skip
    assert (code, json.loads(out)["ttl"]) == (0, 120.0)


def test_a_mistake_shows_the_usage_of_its_own_command(capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(capsys, "lease", "claim", "j", "--ttl", "soon")
    assert err.startswith("usage: fenceproxy lease ")
    assert "fenceproxy lease: error: argument --ttl: expected seconds or a duration" in err
    err = usage_error(capsys, "lease", "renew", "j", "--owner", "w")
    assert err.startswith("usage: fenceproxy lease ")
    assert err.endswith("fenceproxy lease: error: lease renew needs --generation\n")
    err = usage_error(capsys, "jobs", "show")
    assert err.startswith("usage: fenceproxy jobs ")


def test_a_ttl_is_above_zero_where_a_wait_or_grace_may_be_zero(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A lease of no time is a usage error, for ``lease`` and ``run`` alike (``run``
    exits with its own usage code); ``run``'s ``--wait`` and ``--grace`` take 0 (do
    not wait; kill at once), and a duration that is not one is refused under its own
    option."""
    assert "error: argument --ttl: must be above 0" in usage_error(
        capsys, "lease", "claim", "j", "--ttl", "0s"
    )
    assert cli.main(["run", "j", "--ttl", "0s", "--", "true"]) == USAGE
    assert "error: argument --ttl: must be above 0" in capsys.readouterr().err
    assert cli.main(["run", "j", "--grace", "soon", "--", "true"]) == USAGE
    assert "error: argument --grace: expected seconds or a duration" in capsys.readouterr().err
    args = cli._parser()[0].parse_args(["run", "j", "--wait", "0", "--grace", "0ms", "--", "true"])
    assert (args.wait, args.grace) == (0.0, 0.0)


def test_a_url_without_a_scheme_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(capsys, "lease", "show", "j", "--url", "127.0.0.1:8080")
    assert err.endswith(
        "fenceproxy lease: error: --url: the lease API's URL needs a scheme, such as "
        "http://127.0.0.1:8080\n"
    )


def test_help_is_written_for_people(capsys: pytest.CaptureFixture[str]) -> None:
    for command in (["chaos"], ["lease"], ["jobs"], ["serve"], []):
        with pytest.raises(SystemExit):
            cli.main([*command, "--help"])
        text = capsys.readouterr().out
        assert "``" not in text
        assert ":mod:" not in text
        assert text.startswith("usage: fenceproxy")


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from fenceproxy import __version__

    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out == f"fenceproxy {__version__}\n"


async def test_lease_show_of_a_fenced_job_without_a_lease_shows_its_fence(
    proxy: Client, capsys: pytest.CaptureFixture[str]
) -> None:
    url = str(proxy.make_url("")).rstrip("/")
    assert (await fenced(proxy, "legacy", 7)).status == 200  # generations from elsewhere
    code, out, _ = await run(capsys, "lease", "show", "legacy", "--url", url)
    assert (code, json.loads(out)) == (
        0,
        {"job_id": "legacy", "lease": None, "fence_generation": 7},
    )
    code, out, _ = await run(capsys, "lease", "show", "nothing", "--url", url)
    assert code == 1
    assert json.loads(out)["type"] == "urn:fenceproxy:problem:lease-not-found"
