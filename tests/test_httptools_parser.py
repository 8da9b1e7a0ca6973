"""The request parser's adapter (fenceproxy.http.httptools_parser): every exception
class httptools defines is in its table, and the real parser, fed the input behind
each row, is answered as the table says: never a 500, never the bytes it was fed."""

from __future__ import annotations

import httptools
import pytest
from httptools.parser import errors as httptools_errors

from fenceproxy.errors import (
    InternalError,
    RequestHeadTooLarge,
    RequestMalformed,
    VersionNotSupported,
)
from fenceproxy.http.httptools_parser import ERRORS, parser_refusal


class _Head:
    """Callbacks that refuse a field named X-Refuse, as the data plane's do."""

    def on_header(self, name: bytes, value: bytes) -> None:
        if name == b"X-Refuse":
            raise RequestHeadTooLarge("the head is too large")
        if name == b"X-Bug":
            raise KeyError("a bug")


def parse(data: bytes) -> Exception:
    parser = httptools.HttpRequestParser(_Head())
    with pytest.raises(Exception) as caught:  # noqa: PT011 - each row's class is asserted
        parser.feed_data(data)
    return caught.value


def test_every_exception_httptools_defines_is_in_the_table() -> None:
    defined = {getattr(httptools_errors, name) for name in httptools_errors.__all__}
    assert defined == set(ERRORS)


def test_the_http2_preface_is_505() -> None:
    exc = parse(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    assert type(exc) is httptools.HttpParserError
    refusal = parser_refusal(exc)
    assert isinstance(refusal, VersionNotSupported)


@pytest.mark.parametrize(
    ("data", "cls"),
    [
        (b"post /x HTTP/1.1\r\n\r\n", httptools.HttpParserInvalidMethodError),
        (b"GET /a\x7fb HTTP/1.1\r\n\r\n", httptools.HttpParserInvalidURLError),
        (b"GET / HTTP/1.1\r\nX-A: 1\nX-B: 2\r\n\r\n", httptools.HttpParserError),
        (b"GET / HTTP/1.1\r\nX-A: a\x01b\r\n\r\n", httptools.HttpParserError),
    ],
    ids=["method", "target", "bare-lf", "control-character"],
)
def test_what_llhttp_refuses_is_400_naming_its_reason_not_the_bytes(
    data: bytes, cls: type[Exception]
) -> None:
    exc = parse(data)
    assert type(exc) is cls
    refusal = parser_refusal(exc)
    assert isinstance(refusal, RequestMalformed)
    assert refusal.detail.startswith("the request is not valid HTTP/1.1: ")
    assert "\x01" not in refusal.detail
    assert "\x7f" not in refusal.detail


def test_a_refusal_raised_by_a_callback_is_the_answer() -> None:
    exc = parse(b"GET / HTTP/1.1\r\nX-Refuse: 1\r\nHost: a\r\n\r\n")
    assert type(exc) is httptools.HttpParserCallbackError
    refusal = parser_refusal(exc)
    assert isinstance(refusal, RequestHeadTooLarge)


def test_a_callback_that_fails_otherwise_is_a_bug_answered_500(
    caplog: pytest.LogCaptureFixture,
) -> None:
    exc = parse(b"GET / HTTP/1.1\r\nX-Bug: 1\r\nHost: a\r\n\r\n")
    assert isinstance(parser_refusal(exc), InternalError)
    assert "a parser callback failed" in caplog.text


def test_an_upgrade_is_not_an_error_but_where_http_ends() -> None:
    data = b"GET / HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\nNOT-HTTP"
    exc = parse(data)
    assert type(exc) is httptools.HttpParserUpgrade
    assert data[exc.args[0] :] == b"NOT-HTTP"
