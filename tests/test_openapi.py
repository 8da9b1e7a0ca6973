"""The lease API against its OpenAPI file (``fenceproxy/server/lease-api.json``), the
description clients in other languages are generated from: served at
``{prefix}/openapi.json``, and checked by schemathesis against a running proxy, every
answer (a success or a refusal) of the status, type and shape the file says."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from importlib.resources import files
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import negative_data_rejection, positive_data_acceptance

from fenceproxy.errors import FencingHeaderMalformed
from fenceproxy.fence.fencing import parse_job
from fenceproxy.testing import free_port

SPEC = files("fenceproxy.server").joinpath("lease-api.json")
schema = schemathesis.openapi.from_path(str(SPEC))


@pytest.fixture(scope="module")
def lease_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real proxy serving its lease API alone, with its prefix elsewhere than the
    file's default: the served file says where it is. A claim's wait is held to
    100 ms, so a busy job's claim with any wait is answered within the client's time."""
    folder = tmp_path_factory.mktemp("openapi")
    config = folder / "proxy.yaml"
    config.write_text(
        f"store: sqlite:///{folder / 'fences.db'}\nleases: {{prefix: /leases, max_wait: 100ms}}\n"
    )
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "fenceproxy", "serve", "-c", str(config),
         "--listen", f"127.0.0.1:{port}", "--admin", "off"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while True:  # until it accepts connections
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert process.poll() is None
                assert time.monotonic() < deadline
                time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait()


def test_the_api_serves_its_description_at_its_prefix(lease_api: str) -> None:
    with urllib.request.urlopen(f"{lease_api}/leases/openapi.json") as answer:
        assert answer.headers["Content-Type"].startswith("application/json")
        served = json.load(answer)
    shipped = json.loads(SPEC.read_text())
    assert served["servers"] == [{"url": "/leases"}]
    assert {**served, "servers": shipped["servers"]} == shipped
    assert sorted(served["paths"]) == [
        "/{job}", "/{job}/claim", "/{job}/complete", "/{job}/release", "/{job}/renew",
    ]  # fmt: skip


def _wider_than_the_pattern(value: object) -> bool:
    """A job id or owner outside the file's pattern (printable ASCII, the portable
    part) that the API takes by design: UTF-8 without control or format characters.
    schemathesis holds some path values percent-encoded already: those count as
    what the API decodes them to."""
    if not isinstance(value, str):
        return False
    if value.isascii():
        value = urllib.parse.unquote(value, errors="surrogateescape")
        if value.isascii():
            return False
    try:
        parse_job(value, "test")
    except FencingHeaderMalformed:
        return False
    return True


def negative_data_rejected(ctx: Any, response: Any, case: schemathesis.Case) -> bool | None:
    """schemathesis's own check that invalid data is refused, passed over for a case
    whose job id or owner is non-ASCII text the API takes."""
    body = case.body if isinstance(case.body, dict) else {}
    if any(
        map(_wider_than_the_pattern, ((case.path_parameters or {}).get("job"), body.get("owner")))
    ):
        return None
    return negative_data_rejection(ctx, response, case)


_JOB_PARAMETER = json.loads(SPEC.read_text())["paths"]["/{job}"]["get"]["parameters"][0]
_JOB = re.compile(_JOB_PARAMETER["schema"]["pattern"])


def _outside_the_pattern(job: object) -> bool:
    """A job id the file's own pattern does not take, once decoded as the API decodes
    it: schemathesis holds some already percent-encoded (``%3A%0DN`` is ``:\\rN``)."""
    if not isinstance(job, str):
        return False
    return not _JOB.search(urllib.parse.unquote(job, errors="surrogateescape"))


def positive_data_accepted(ctx: Any, response: Any, case: schemathesis.Case) -> bool | None:
    """schemathesis's own check that valid data is taken, passed over for a case it
    labels valid whose job id is outside the file's own pattern (it draws one now and
    then, a control character in it): the API refuses such a job id, as it must."""
    if _outside_the_pattern((case.path_parameters or {}).get("job")):
        return None
    return positive_data_acceptance(ctx, response, case)


def test_a_job_id_is_judged_as_the_api_decodes_it() -> None:
    """A control character held percent-encoded is outside the pattern, as it is raw;
    a printable id, encoded or not, is inside."""
    assert _outside_the_pattern("%3A%0DN")
    assert _outside_the_pattern(":\rN")
    assert not _outside_the_pattern("invoice%2F42")
    assert not _outside_the_pattern("invoice-42")


@schema.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_answer_is_what_the_description_says(case: schemathesis.Case, lease_api: str) -> None:
    case.call_and_validate(
        base_url=f"{lease_api}/leases",
        excluded_checks=[negative_data_rejection, positive_data_acceptance],
        additional_checks=[negative_data_rejected, positive_data_accepted],
    )


def test_the_shipped_file_is_the_one_in_the_package() -> None:
    assert Path(str(SPEC)).name == "lease-api.json"
    assert json.loads(SPEC.read_text())["openapi"] == "3.1.0"
