"""The aiohttp client adapter (fenceproxy.http.aiohttp_client): every exception class
aiohttp's client and parser define is caught and mapped to the UpstreamError the
table says, a timeout becomes UpstreamTimeout there and nowhere else, and the client
protocol's surface that the upstream client drives exists on the installed aiohttp."""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import client_exceptions
from aiohttp.base_protocol import BaseProtocol
from aiohttp.client_proto import ResponseHandler
from aiohttp.http import StreamWriter
from aiohttp.http_exceptions import BadStatusLine, HttpProcessingError
from aiohttp.http_parser import HttpResponseParser

import fenceproxy
from fenceproxy.errors import UpstreamFailed, UpstreamTimeout, UpstreamUnreachable
from fenceproxy.http.aiohttp_client import (
    CONNECT_FAILURES,
    FAILURES,
    connect_failure,
    map_failure,
    stream_writer,
)

# Exported by aiohttp.client_exceptions but raised by its websocket client only.
NOT_RAISED_HERE = {client_exceptions.WSMessageTypeError}


def _subclasses(cls: type[BaseException]) -> Iterator[type[BaseException]]:
    yield cls
    for sub in cls.__subclasses__():
        yield from _subclasses(sub)


def _aiohttp_errors() -> list[type[BaseException]]:
    found = {getattr(client_exceptions, name) for name in client_exceptions.__all__}
    found |= set(_subclasses(HttpProcessingError))
    found |= set(_subclasses(client_exceptions.ClientError))
    return sorted(
        (c for c in found if c.__module__.startswith("aiohttp") and c not in NOT_RAISED_HERE),
        key=lambda c: c.__qualname__,
    )


AIOHTTP_ERRORS = _aiohttp_errors()


def test_aiohttp_defines_what_the_table_names() -> None:
    assert len(AIOHTTP_ERRORS) > 30
    assert client_exceptions.ServerTimeoutError in AIOHTTP_ERRORS
    assert BadStatusLine in AIOHTTP_ERRORS


@pytest.mark.parametrize("cls", AIOHTTP_ERRORS, ids=lambda c: c.__qualname__)
def test_every_aiohttp_error_is_caught_and_mapped(cls: type[BaseException]) -> None:
    assert issubclass(cls, FAILURES), f"{cls.__qualname__} would escape as a 500"
    exc = cls.__new__(cls)  # as raised, less the arguments each wants
    if isinstance(exc, HttpProcessingError):
        exc.message = "Bad status line:\n  b'quoted'"
    mapped = map_failure(exc)
    expected = UpstreamTimeout if issubclass(cls, TimeoutError) else UpstreamFailed
    assert type(mapped) is expected
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


def test_a_malformed_answer_from_the_real_parser_names_its_reason() -> None:
    loop = asyncio.new_event_loop()
    try:
        parser = HttpResponseParser(BaseProtocol(loop), loop, 2**16)
        with pytest.raises(HttpProcessingError) as caught:
            parser.feed_data(b"HTTP/1.1 2000 OK\r\n\r\n")
    finally:
        loop.close()
    assert isinstance(caught.value, BadStatusLine)
    assert map_failure(caught.value).detail == (
        "the upstream's answer was malformed (Bad status line:); it may have applied the write"
    )


def test_a_timeout_becomes_upstream_timeout_in_the_adapter_only() -> None:
    package = Path(fenceproxy.__file__).parent
    makers = {
        path.name
        for path in package.rglob("*.py")
        if re.search(r"(?<!class )\bUpstreamTimeout\(", path.read_text())
    }
    assert makers == {"aiohttp_client.py"}


async def test_the_client_protocol_surface_the_upstream_client_drives_exists() -> None:
    loop = asyncio.get_running_loop()
    conn = ResponseHandler(loop)
    assert conn._loop is loop  # read by stream_writer
    writer = stream_writer(conn)
    assert isinstance(writer, StreamWriter)
    for name in ("enable_chunking", "write_headers", "write", "write_eof"):
        assert callable(getattr(writer, name))
    params = inspect.signature(conn.set_response_params).parameters
    for name in (
        "skip_payload",
        "auto_decompress",
        "read_timeout",
        "max_line_size",
        "max_field_size",
        "max_headers",
    ):
        assert name in params
    for name in ("start_timeout", "read", "is_connected", "abort", "close"):
        assert callable(getattr(conn, name))
    assert isinstance(conn.should_close, bool)
    assert conn.closed is None or isinstance(conn.closed, asyncio.Future)
    assert conn.transport is None
