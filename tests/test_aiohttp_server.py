"""The aiohttp server adapter (fenceproxy.http.aiohttp_server): the private names it
reads exist on the installed aiohttp and are read nowhere else, the public surface
the edge relies on is there, and what the request parser raises is answered as the
adapter's table says, pinned against the real parser."""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web, web_protocol
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_exceptions import BadHttpMessage, HttpProcessingError, LineTooLong
from aiohttp.http_parser import HttpRequestParser
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler

import fenceproxy
from fenceproxy.errors import (
    BodyTimeout,
    ClientClosedRequest,
    Refusal,
    RequestHeadTooLarge,
    RequestMalformed,
)
from fenceproxy.http import aiohttp_server
from fenceproxy.http.aiohttp_server import (
    BODY_FAILURES,
    PARSER_TEXTS,
    HandlerBase,
    ServerBase,
    body_refusal,
    clear_buffer,
    request_refusal,
)

# The private names the adapter reads, by the class that has them.
PRIVATE_READS = {
    web.Server: ("_kwargs", "_loop"),
    RequestHandler: (
        "_request_in_progress",
        "_current_request",
        "_messages",
        "_request_count",
        "_force_close",
        "_loop",
    ),
    StreamReader: ("_buffer", "_size"),
}


async def _handler() -> tuple[ServerBase, HandlerBase]:
    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        return web.Response()

    class Server(ServerBase):
        def __call__(self) -> HandlerBase:
            return HandlerBase(self, loop=self.event_loop, **self.handler_kwargs)

    server = Server(handle, max_line_size=100)
    return server, server()


async def test_every_private_name_the_adapter_reads_exists_on_this_aiohttp() -> None:
    server, handler = await _handler()
    payload = StreamReader(BaseProtocol(asyncio.get_running_loop()), 2**16)
    for instance in (server, handler, payload):
        names = next(v for k, v in PRIVATE_READS.items() if isinstance(instance, k))
        for name in names:
            assert hasattr(instance, name), f"aiohttp no longer has {type(instance)}.{name}"
    # And read through the adapter, each gives what it says.
    assert server.handler_kwargs == {"max_line_size": 100}
    assert server.event_loop is asyncio.get_running_loop()
    assert handler.event_loop is asyncio.get_running_loop()
    assert (handler.request_in_progress, handler.current_request) == (False, None)
    assert (handler.messages_waiting, handler.request_count, handler.force_closing) == (
        False,
        0,
        False,
    )
    payload.feed_data(b"unread")
    clear_buffer(payload)
    assert (payload._size, len(payload._buffer)) == (0, 0)


def test_the_adapters_names_shadow_nothing_of_aiohttps() -> None:
    for base, ours in ((web.Server, ServerBase), (RequestHandler, HandlerBase)):
        added = set(vars(ours)) - {"__module__", "__doc__", "__slots__", "__qualname__"}
        assert added, ours
        for name in added:
            assert not hasattr(base, name), f"{base.__name__}.{name} exists already"


def _package_sources() -> Iterator[tuple[Path, str]]:
    for path in Path(fenceproxy.__file__).parent.rglob("*.py"):
        yield path, path.read_text()


def test_aiohttps_private_names_are_read_in_the_adapters_only() -> None:
    """A module that reads one of these names, and does not set it on itself, reads
    aiohttp's: only the adapters may (the client's adapter reads the protocol's
    ``_loop``)."""
    allowed = {"aiohttp_server.py"}
    for name in {name for names in PRIVATE_READS.values() for name in names}:
        read = re.compile(rf"\.{name}\b")
        own = re.compile(rf"self\.{name}\s*[:=]|__slots__ = \([^)]*\"{name}\"")
        readers = {
            path.name
            for path, text in _package_sources()
            if read.search(text) and not own.search(text)
        }
        expected = allowed | {"aiohttp_client.py"} if name == "_loop" else allowed
        assert readers == expected, name


def test_the_public_surface_the_edge_relies_on_exists() -> None:
    assert "request_factory" in inspect.signature(web.Server.__init__).parameters
    factory = inspect.signature(web.Server._make_request).parameters  # what a factory gets
    assert list(factory) == ["self", "message", "payload", "protocol", "writer", "task"]
    assert list(inspect.signature(RequestHandler.handle_error).parameters) == [
        "self",
        "request",
        "status",
        "exc",
        "message",
    ]
    assert list(inspect.signature(RequestHandler.finish_response).parameters) == [
        "self",
        "request",
        "resp",
        "start_time",
    ]
    for name in ("data_received", "connection_made", "connection_lost", "force_close"):
        assert callable(getattr(RequestHandler, name))
    for name in ("max_line_size", "max_headers", "lingering_time", "keepalive_timeout"):
        assert name in inspect.signature(RequestHandler.__init__).parameters
    assert "max_line_size" in RequestHandler.__slots__
    assert "max_headers" in RequestHandler.__slots__


# -- the request parser's errors, from the real parser ----------------------------

# What makes the parser raise each of the texts the adapter matches.
TEXT_INPUTS = {
    "Too many headers received": b"GET / HTTP/1.1\r\n"
    + b"".join(b"X-%d: a\r\n" % n for n in range(11))
    + b"\r\n",
    "Pause on PRI/Upgrade": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
}


def _parse(data: bytes) -> HttpProcessingError:
    """What the parser aiohttp's server uses raises on ``data`` (max 10 headers)."""
    loop = asyncio.new_event_loop()
    try:
        parser = HttpRequestParser(
            BaseProtocol(loop), loop, 2**16, max_line_size=100, max_field_size=100, max_headers=10
        )
        with pytest.raises(HttpProcessingError) as caught:
            parser.feed_data(data)
        return caught.value
    finally:
        loop.close()


def test_the_server_parses_with_the_c_parser_the_pins_are_taken_on() -> None:
    assert web_protocol.HttpRequestParser is HttpRequestParser
    assert HttpRequestParser.__module__ == "aiohttp._http_parser"


@pytest.mark.parametrize("text", sorted(PARSER_TEXTS))
def test_each_matched_text_is_what_the_real_parser_says(text: str) -> None:
    exc = _parse(TEXT_INPUTS[text])
    assert type(exc) is BadHttpMessage  # no type of its own: hence the text
    assert aiohttp_server.reason(exc) == text
    assert type(request_refusal(exc, 100, 10)) is PARSER_TEXTS[text]


def test_a_line_too_long_is_told_by_its_type() -> None:
    exc = _parse(b"GET /" + b"a" * 200 + b" HTTP/1.1\r\n\r\n")
    assert isinstance(exc, LineTooLong)
    refusal = request_refusal(exc, 100, 10)
    assert isinstance(refusal, RequestHeadTooLarge)
    assert refusal.detail == (
        "the request line or a header is longer than 100 bytes, or there are more than 10 headers"
    )


def test_pri_in_the_bytes_of_a_malformed_request_is_not_http2() -> None:
    """Only the preface's own reason means HTTP/2: the parser quotes the bytes it
    refused, and those may say PRI anywhere."""
    exc = _parse(b"GET / HTTP/1.1\r\nX-PRIORITY: \x01\r\n\r\n")
    assert "PRI" in str(exc.message)
    refusal = request_refusal(exc, 100, 10)
    assert isinstance(refusal, RequestMalformed)
    assert refusal.detail.startswith("the request is not valid HTTP/1.1: ")
    assert "\x01" not in refusal.detail  # the quoted bytes are left out


def _subclasses(cls: type[BaseException]) -> Iterator[type[BaseException]]:
    yield cls
    for sub in cls.__subclasses__():
        yield from _subclasses(sub)


PARSER_ERRORS = sorted(
    {c for c in _subclasses(HttpProcessingError) if c.__module__.startswith("aiohttp")},
    key=lambda c: c.__qualname__,
)


@pytest.mark.parametrize("cls", PARSER_ERRORS, ids=lambda c: c.__qualname__)
def test_every_parser_error_is_answered_as_a_refusal(cls: type[HttpProcessingError]) -> None:
    exc = cls.__new__(cls)
    exc.message = "Something: b'quoted'"
    head = request_refusal(exc, 100, 10)
    expected = RequestHeadTooLarge if issubclass(cls, LineTooLong) else RequestMalformed
    assert type(head) is expected
    body = body_refusal(exc, timeout=1.0, expired=False)
    assert type(body) is RequestMalformed
    assert body.detail == "the body's framing is broken: Something"
    assert issubclass(cls, BODY_FAILURES)


@pytest.mark.parametrize(
    ("exc", "expired", "expected"),
    [
        (TimeoutError(), True, BodyTimeout),
        (TimeoutError(), False, ClientClosedRequest),
        (ConnectionResetError(), False, ClientClosedRequest),
        (OSError(), False, ClientClosedRequest),
    ],
)
def test_a_body_that_stops_or_breaks_is_answered_by_the_table(
    exc: BaseException, expired: bool, expected: type[Refusal]
) -> None:
    assert isinstance(exc, BODY_FAILURES)
    assert type(body_refusal(exc, timeout=2.0, expired=expired)) is expected
