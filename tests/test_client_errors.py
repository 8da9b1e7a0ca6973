"""The upstream client's failures (fenceproxy.http.client_errors): every exception
class httptools defines, the socket's and a deadline's, is caught and becomes the
UpstreamError the table says; the real response parser's reasons are named, never
the bytes it was fed; and a timeout becomes UpstreamTimeout there and nowhere else."""

from __future__ import annotations

import re
from pathlib import Path

import httptools
import pytest
from httptools.parser import errors as httptools_errors

import fenceproxy
from fenceproxy.errors import UpstreamFailed, UpstreamTimeout, UpstreamUnreachable
from fenceproxy.http.client_errors import CONNECT_FAILURES, FAILURES, connect_failure, map_failure

HTTPTOOLS_ERRORS = sorted(
    (getattr(httptools_errors, name) for name in httptools_errors.__all__),
    key=lambda c: c.__qualname__,
)


@pytest.mark.parametrize("cls", HTTPTOOLS_ERRORS, ids=lambda c: c.__qualname__)
def test_every_httptools_error_is_caught_and_mapped(cls: type[Exception]) -> None:
    assert issubclass(cls, FAILURES), f"{cls.__qualname__} would escape as a 500"
    mapped = map_failure(cls("Invalid something"))
    assert type(mapped) is UpstreamFailed
    assert mapped.sent


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (TimeoutError(), UpstreamTimeout),
        (ConnectionResetError(), UpstreamFailed),
        (BrokenPipeError(), UpstreamFailed),
        (OSError(), UpstreamFailed),
    ],
)
def test_the_socket_and_a_deadline_are_mapped_too(
    exc: BaseException, expected: type[BaseException]
) -> None:
    assert isinstance(exc, FAILURES)
    assert type(map_failure(exc)) is expected


def test_a_failure_to_connect_is_unreachable_and_says_why() -> None:
    for exc in (TimeoutError(), ConnectionRefusedError(111, "Connection refused"), OSError()):
        assert isinstance(exc, CONNECT_FAILURES)
        assert type(connect_failure(exc, 5.0)) is UpstreamUnreachable
        assert not connect_failure(exc, 5.0).sent
    assert connect_failure(TimeoutError(), 2.5).detail == (
        "could not connect to the upstream within 2.5s"
    )
    refused = connect_failure(ConnectionRefusedError(111, "Connection refused"), 5.0)
    assert refused.detail == "could not connect to the upstream: Connection refused"
    assert connect_failure(OSError(), 5.0).detail == "could not connect to the upstream: OSError"


class _Nothing:
    pass


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (b"HTTP/1.1 2000 OK\r\n\r\n", "Invalid response status"),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: x\x01\r\n\r\n",
            "Invalid character in Content-Length",
        ),
    ],
)
def test_a_malformed_answer_from_the_real_parser_names_its_reason(
    answer: bytes, reason: str
) -> None:
    parser = httptools.HttpResponseParser(_Nothing())
    with pytest.raises(httptools.HttpParserError) as caught:
        parser.feed_data(answer)
    detail = map_failure(caught.value).detail
    assert (
        detail == f"the upstream's answer was malformed ({reason}); it may have applied the write"
    )
    assert "\x01" not in detail


def test_a_switch_of_protocols_is_named() -> None:
    parser = httptools.HttpResponseParser(_Nothing())
    with pytest.raises(httptools.HttpParserUpgrade) as caught:
        parser.feed_data(b"HTTP/1.1 101 Switching\r\nConnection: upgrade\r\nUpgrade: x\r\n\r\n")
    assert map_failure(caught.value).detail == (
        "the upstream switched protocols, which is not proxied"
    )


def test_a_timeout_becomes_upstream_timeout_in_the_adapter_only() -> None:
    package = Path(fenceproxy.__file__).parent
    makers = {
        path.name
        for path in package.rglob("*.py")
        if re.search(r"(?<!class )\bUpstreamTimeout\(", path.read_text())
    }
    assert makers == {"client_errors.py"}
