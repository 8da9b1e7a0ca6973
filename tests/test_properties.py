"""Property tests at the edges a client or an operator controls, end to end.

* Random bytes in the fencing headers, sent as raw HTTP/1.1 over a real socket: the
  answer is 2xx only for a well-formed write the fence admits (or replays), never 5xx,
  and a refused write never reaches the upstream.
* Random job ids in the lease API's path and random JSON-ish bodies: only the
  documented statuses, never a 500, never anything upstream.
* Random YAML and random text as a config file, and random one-key mutations of
  config/example.yaml: a Config or a ConfigError naming the file (and the key),
  never another exception.
* A model-based run of one job's writes through the real proxy: the answers and what
  the upstream received match a tiny model of the fence and the idempotency keys.

Hypothesis runs each example inside one test function, so proxies started by
fixtures live across examples: every example starts from a fresh store or job.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import tempfile
import unicodedata
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import yaml
from aiohttp.test_utils import TestClient
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from fenceproxy.config import Config, load_config, parse_config
from fenceproxy.errors import ConfigError
from fenceproxy.fence.fencing import GENERATION_MAX, JOB_MAX_BYTES, KEY_MAX_CHARS
from fenceproxy.server.app import FenceProxy
from fenceproxy.testing import ProxyTestServer, RecordingUpstream

from .conftest import ProxyFactory, fenced, raw_request

Client = TestClient[Any, Any]

# Fixtures are set up once per test, not per example; every test here starts what
# it needs per example itself (a fresh store, a fresh job) so examples are independent.
NETWORK = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
OFFLINE = settings(max_examples=150, deadline=None)
# Passing, each network property takes about a second; shrinking a failure through
# fresh proxies may take a minute, more than the suite's per-test timeout.
SHRINK_TIME = pytest.mark.timeout(300)

_examples = itertools.count()


# --- raw HTTP ------------------------------------------------------------------------


def _request(
    method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes = b"{}"
) -> bytes:
    lines = [
        method + b" " + target + b" HTTP/1.1",
        b"Host: proxy",
        b"Content-Type: application/json",
        b"Content-Length: %d" % len(body),
        *(name + b": " + value for name, value in headers),
        b"Connection: close",
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _status(answer: bytes) -> int:
    m = re.match(rb"HTTP/1\.[01] ([0-9]{3}) ", answer)
    assert m is not None, answer[:300]
    return int(m.group(1))


def _head_and_body(answer: bytes) -> tuple[bytes, bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return head, body


# --- 1. random bytes in the fencing headers ------------------------------------------

OWS = b" \t"  # what the HTTP parser strips around a header value

# Arbitrary bytes that keep the request one header line.
RAW_VALUE = st.binary(max_size=300).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
PADDING = st.sampled_from([b"", b"", b" ", b"\t", b"  ", b" \t"])


def _padded(values: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    return st.builds(lambda a, v, b: a + v + b, PADDING, values, PADDING)


# Job ids, valid often enough for generations to collide (-> 409) and keys to repeat
# (-> replay): a small pool, boundary lengths, any UTF-8 text, and raw bytes.
JOB_VALUE = st.one_of(
    RAW_VALUE,
    _padded(
        st.sampled_from(
            [b"job-a", b"job-b", "é".encode(), b"x" * 256, b"x" * 257, "é".encode() * 129]
        )
    ),
    _padded(st.text(st.characters(codec="utf-8"), min_size=1, max_size=20).map(str.encode)),
    _padded(st.sampled_from(["\u00a0", "\u2028", "\u200b", "\x85", "\ufeff"]).map(str.encode)),
)
TOKEN_VALUE = st.one_of(
    RAW_VALUE,
    _padded(st.integers(min_value=0, max_value=5).map(lambda n: str(n).encode())),
    _padded(st.integers(min_value=0, max_value=2**64).map(lambda n: str(n).encode())),
    _padded(
        st.sampled_from(
            [
                str(GENERATION_MAX).encode(),
                str(GENERATION_MAX + 1).encode(),
                b"0007",
                b"0" * 19 + b"1",
                b"-1",
                b"+1",
                b"1_0",
                b"1 2",
                b"1e3",
                "\u0663".encode(),
                "\uff13".encode(),
            ]
        )
    ),
)
KEY_VALUE = st.one_of(
    st.none(),
    RAW_VALUE,
    _padded(st.sampled_from([b"k1", b"k2", b"a b", b"k" * 255, b"k" * 256, "clé".encode()])),
    _padded(
        st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=20).map(str.encode)
    ),
)
FENCED_REQUEST = st.one_of(
    st.tuples(
        st.one_of(JOB_VALUE, JOB_VALUE, st.none()),  # None: the header is left out
        st.one_of(TOKEN_VALUE, TOKEN_VALUE, st.none()),
        KEY_VALUE,
    ),
    # Well-formed writes on two jobs, so that generations go stale and keys repeat.
    st.tuples(
        _padded(st.sampled_from([b"job-a", b"job-b"])),
        _padded(st.integers(min_value=0, max_value=5).map(lambda n: str(n).encode())),
        st.one_of(st.none(), _padded(st.sampled_from([b"k1", b"k2"]))),
    ),
)

_DIGITS = re.compile(rb"[0-9]{1,19}")
_KEY = re.compile(rb"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?")


def _job_if_acceptable(raw: bytes, *, strip: bool = True) -> str | None:
    """The job id the proxy should fence under, or None if it must refuse it. A header
    value loses its surrounding spaces and tabs to the HTTP parser, a path does not."""
    try:
        job = (raw.strip(OWS) if strip else raw).decode("utf-8")
    except UnicodeDecodeError:
        return None
    size = len(job.encode("utf-8"))
    if not 1 <= size <= JOB_MAX_BYTES:
        return None
    if any(unicodedata.category(c) in ("Cc", "Cf", "Cs") for c in job):
        return None
    return job


def _token_if_acceptable(raw: bytes) -> str | None:
    token = raw.strip(OWS)
    if not _DIGITS.fullmatch(token) or int(token) > GENERATION_MAX:
        return None
    return token.decode("ascii")


def _key_if_acceptable(raw: bytes) -> str | None:
    key = raw.strip(OWS)
    if len(key) > KEY_MAX_CHARS or not _KEY.fullmatch(key):
        return None
    return key.decode("ascii")


@asynccontextmanager
async def _fresh_proxy(
    upstream: RecordingUpstream, directory: Path, **top: Any
) -> AsyncIterator[int]:
    """A proxy on its own new store, for one example; yields its port. ``top`` goes to
    the config."""
    config = parse_config(
        {
            "store": f"sqlite:///{directory / f'example-{next(_examples)}.db'}",
            "routes": [{"name": "billing", "path": "/billing/", "upstream": upstream.url}],
            **top,
        },
        "test.yaml",
    )
    async with ProxyTestServer(FenceProxy(config)) as server:
        assert server.port is not None
        yield server.port


@given(st.lists(FENCED_REQUEST, min_size=20, max_size=40))
@NETWORK
@SHRINK_TIME
async def test_random_fencing_header_bytes_are_admitted_only_when_well_formed_and_fresh(
    upstream: RecordingUpstream,
    tmp_path: Path,
    requests: list[tuple[bytes | None, bytes | None, bytes | None]],
) -> None:
    highest: dict[str, int] = {}
    completed: set[tuple[str, str]] = set()  # (job, key): same method, path and body
    async with _fresh_proxy(upstream, tmp_path) as port:
        for raw_job, raw_token, raw_key in requests:
            headers = [
                (name, value)
                for name, value in (
                    (b"Fencing-Job", raw_job),
                    (b"Fencing-Token", raw_token),
                    (b"Idempotency-Key", raw_key),
                )
                if value is not None
            ]
            before = len(upstream.received)
            answer = await raw_request(port, _request(b"POST", b"/billing/x", headers))

            # A comma-joined list in a fencing field is refused: it is not one value.
            job = None if raw_job is None or b"," in raw_job else _job_if_acceptable(raw_job)
            token = None if raw_token is None else _token_if_acceptable(raw_token)
            key = None if raw_key is None or b"," in raw_key else _key_if_acceptable(raw_key)
            if job is None or token is None or (raw_key is not None and key is None):
                expected = "refused"
            elif key is not None and (job, key) in completed:
                expected = "replayed"
            elif job in highest and int(token) < highest[job]:
                expected = "stale"
            else:
                expected = "admitted"

            event(expected)
            context = (raw_job, raw_token, raw_key, answer[:300])
            if not answer:  # only the HTTP parser may hang up without a word
                assert expected == "refused", context
                assert len(upstream.received) == before, context
                continue
            status = _status(answer)
            assert status < 500, context
            head, _ = _head_and_body(answer)
            replayed = b"\r\nidempotent-replayed: true" in head.lower()
            if expected in ("refused", "stale"):
                assert 400 <= status < 500, context
                if expected == "stale":
                    assert status == 409, context
                assert len(upstream.received) == before, context
            elif expected == "replayed":
                assert status == 200, context
                assert replayed, context
                assert len(upstream.received) == before, context
            else:
                assert job is not None
                assert token is not None
                assert status == 200, context
                assert not replayed, context
                assert len(upstream.received) == before + 1, context
                got = upstream.received[-1].headers
                assert got["Fencing-Job"] == job, context
                assert got["Fencing-Token"] == token, context
                assert got.get("Idempotency-Key") == key, context
                highest[job] = max(highest.get(job, 0), int(token))
                if key is not None:
                    completed.add((job, key))


# --- 2. the lease API ----------------------------------------------------------------

LEASE_STATUSES = {200, 400, 404, 409, 422}
LEASE_BODIES = {
    b"claim": b'{"owner": "o"}',
    b"renew": b'{"owner": "o", "generation": 1}',
    b"complete": b'{"owner": "o", "generation": 1}',
    b"release": b'{"owner": "o", "generation": 1}',
}
LEASE_JOB_BYTES = st.one_of(
    st.binary(max_size=300),
    st.text(st.characters(codec="utf-8"), max_size=40).map(str.encode),
    st.sampled_from([b"job-a", b".", b"..", b"a/b", b"a+b", b"a%b", b"x" * 257, b"\x00"]),
)
LEASE_ACTION = st.sampled_from([b"claim", b"renew", b"complete", b"release", b""])


@given(st.lists(st.tuples(LEASE_JOB_BYTES, LEASE_ACTION), min_size=20, max_size=40))
@NETWORK
@SHRINK_TIME
async def test_random_job_ids_in_the_lease_path_never_fail_the_server(
    upstream: RecordingUpstream, tmp_path: Path, calls: list[tuple[bytes, bytes]]
) -> None:
    async with _fresh_proxy(upstream, tmp_path, leases={}) as port:
        await _call_lease_paths(port, calls)
    assert upstream.received == []


# What an action may answer for a well-formed job id, with a well-formed body.
LEASE_ANSWERS = {
    b"claim": {200, 409},
    b"renew": {200, 404, 409},
    b"complete": {200, 404, 409},
    b"release": {200, 404, 409},
    b"": {200, 404},
}


async def _call_lease_paths(port: int, calls: list[tuple[bytes, bytes]]) -> None:
    for raw_job, action in calls:
        target = b"/_leases/" + quote(raw_job, safe="").encode("ascii")
        if action:
            request = _request(b"POST", target + b"/" + action, [], LEASE_BODIES[action])
        else:
            request = _request(b"GET", target, [], b"")
        answer = await raw_request(port, request)
        status = _status(answer)
        context = (raw_job, action, answer[:300])
        assert status in LEASE_STATUSES, context
        _, body = _head_and_body(answer)
        answered = json.loads(body)
        assert isinstance(answered, dict), context
        job = _job_if_acceptable(raw_job, strip=False)
        if job is None:
            assert status in (400, 404), context  # 404: an empty job, no such endpoint
        else:
            assert status in LEASE_ANSWERS[action], context
            if status == 200:
                assert answered["job_id"] == job, context


async def test_a_job_id_that_is_not_utf8_in_the_lease_path_is_refused(
    start_proxy: ProxyFactory,
) -> None:
    proxy = await start_proxy(leases={})
    answer = await raw_request(
        proxy.port, _request(b"POST", b"/_leases/%FF/claim", [], LEASE_BODIES[b"claim"])
    )
    assert _status(answer) == 400, answer
    assert b"fencing-header-malformed" in answer


async def test_a_job_id_with_a_brace_can_be_claimed(start_proxy: ProxyFactory) -> None:
    proxy = await start_proxy(leases={})
    answer = await raw_request(
        proxy.port, _request(b"POST", b"/_leases/a%7Bb/claim", [], LEASE_BODIES[b"claim"])
    )
    assert _status(answer) == 200, answer
    assert json.loads(_head_and_body(answer)[1])["job_id"] == "a{b"


async def test_a_path_with_an_encoded_newline_reaches_the_upstream(
    proxy: Client, upstream: RecordingUpstream
) -> None:
    fence = [(b"Fencing-Job", b"j"), (b"Fencing-Token", b"1")]
    answer = await raw_request(proxy.port, _request(b"POST", b"/billing/a%0Ab", fence))
    assert _status(answer) == 200, answer
    assert [r.path_qs for r in upstream.received] == ["/billing/a%0Ab"]


# JSON values with the lease fields' names as likely keys and awkward numbers.
JSON_SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([0, -1, 2**63 - 1, 2**63, 10**30, 10**400]),
    st.floats(),  # NaN and infinities too: Python's json reads and writes them
    st.sampled_from([1e-320, 0.1, 30.0, 86400.0, 86400.5, 1e308]),
    st.text(max_size=20),
    st.sampled_from(["o", "", " ", "x" * 257, "\x00", "\u202e", "\ud800"]),
)
JSON_VALUE = st.recursive(
    JSON_SCALAR,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(
            st.one_of(st.sampled_from(["owner", "ttl", "generation"]), st.text(max_size=8)),
            inner,
            max_size=4,
        ),
    ),
    max_leaves=12,
)
LEASE_FIELDS = st.fixed_dictionaries(
    {"owner": st.one_of(st.just("o"), JSON_SCALAR)},
    optional={"ttl": JSON_SCALAR, "generation": JSON_SCALAR, "extra": JSON_VALUE},
)


def _json_bytes(value: Any, ascii_only: bool) -> bytes:
    # surrogatepass: a lone surrogate becomes bytes that are not UTF-8
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


LEASE_BODY = st.one_of(
    st.builds(_json_bytes, st.one_of(LEASE_FIELDS, LEASE_FIELDS, JSON_VALUE), st.booleans()),
    st.binary(max_size=100),
    st.builds(  # cut short
        lambda body, n: body[:n],
        st.builds(_json_bytes, LEASE_FIELDS, st.booleans()),
        st.integers(min_value=0, max_value=40),
    ),
    st.integers(min_value=1, max_value=20_000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(min_value=1, max_value=20_000).map(lambda n: b'{"owner":' + b"[" * n),
)


@given(
    st.lists(
        st.tuples(st.sampled_from([b"job-a", b"job-b"]), LEASE_ACTION.filter(bool), LEASE_BODY),
        min_size=20,
        max_size=40,
    )
)
@NETWORK
@SHRINK_TIME
async def test_random_lease_request_bodies_get_only_documented_statuses(
    upstream: RecordingUpstream, tmp_path: Path, calls: list[tuple[bytes, bytes, bytes]]
) -> None:
    async with _fresh_proxy(upstream, tmp_path, leases={}) as port:
        for job, action, body in calls:
            answer = await raw_request(
                port, _request(b"POST", b"/_leases/" + job + b"/" + action, [], body)
            )
            context = (job, action, body[:200], answer[:300])
            assert _status(answer) in LEASE_STATUSES, context
            _, answered = _head_and_body(answer)
            assert isinstance(json.loads(answered), dict), context
    assert upstream.received == []


# --- 3. config files -----------------------------------------------------------------

SCHEMA_KEYS = [
    "listen", "store", "routes", "name", "path", "upstream", "fence", "methods",
    "job_header", "token_header", "key_header", "on_duplicate", "timeout",
    "connect_timeout", "quarantine", "max_body", "idempotency", "ttl", "max_response",
    "trusted_proxies", "shutdown_timeout", "leases", "prefix", "default_ttl", "min_ttl",
    "max_ttl",
]  # fmt: skip
PLAUSIBLE = [
    "127.0.0.1:8080", "[::1]:8080", "8080", "sqlite:///x.db",
    "sqlite:////tmp/x.db?synchronous=normal", "postgres://x", "/billing/", "/billing",
    "/orders/{job}/", "/_leases", "/_leases/x/", "billing", "http://127.0.0.1:9000",
    "https://h/api", "http://u:p@h", "ftp://h", "30s", "250ms", "1.5h", "-1s", "0", "1MiB",
    "10 KB", "replay", "reject", "POST", "get", "Fencing-Job", "Idempotency-Key", "10.0.0.0/8",
    "::1", "not-an-ip", "yes", "~", "",
]  # fmt: skip
YAML_TEXT = st.text(st.characters(codec="utf-8"), max_size=20)
YAML_SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    YAML_TEXT,
    st.sampled_from(PLAUSIBLE),
)
YAML_KEY = st.one_of(st.sampled_from(SCHEMA_KEYS), YAML_TEXT)
YAML_TREE = st.recursive(
    YAML_SCALAR,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(YAML_KEY, inner, max_size=5)
    ),
    max_leaves=25,
)
YAML_DOCUMENT = st.one_of(st.dictionaries(YAML_KEY, YAML_TREE, max_size=8), YAML_TREE)

# Pieces of YAML syntax, to make text that is almost YAML more often than random text.
YAML_SYNTAX = [
    "\n", "\n  ", "\n    ", "- ", ": ", "? ", "[", "]", "{", "}", ", ", "&a ", "*a", "!!str ",
    "!!int ", "!!binary ", "!!python/object:os.system ", "!foo ", "<<: ", "'", '"', "\\",
    "# c", "---\n", "...\n", "%YAML 1.1\n", "|\n", ">\n", "~", "routes", "listen", "name",
    "upstream", "fence", "leases", "1e3", "0x1F", "0o17", ".nan", "2001-12-14", "\t", "\x00",
    "\ufeff", "\x85",
]  # fmt: skip
YAML_PIECES = st.lists(st.one_of(st.sampled_from(YAML_SYNTAX), YAML_TEXT), max_size=30).map("".join)


def _load(text: str | bytes) -> Config | ConfigError:
    """load_config on ``text`` in a file: the Config, or the ConfigError raised, whose
    message starts with the file's path. Any other exception is raised: the test fails."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "fenceproxy.yaml"
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text, encoding="utf-8")
        error: ConfigError
        try:
            return load_config(path)
        except ConfigError as exc:
            error = exc
    message = str(error)
    assert error.source == str(path)
    assert message, error.problems
    assert message.startswith(f"{path}: "), message
    return error


@given(YAML_DOCUMENT, st.booleans())
@OFFLINE
def test_random_yaml_documents_give_a_config_or_a_config_error_naming_the_file(
    document: Any, allow_unicode: bool
) -> None:
    result = _load(yaml.safe_dump(document, allow_unicode=allow_unicode))
    assert isinstance(result, Config | ConfigError)


@given(st.one_of(YAML_PIECES, st.text(max_size=200)))
@OFFLINE
def test_random_text_files_give_a_config_or_a_config_error_naming_the_file(text: str) -> None:
    assert isinstance(_load(text), Config | ConfigError)


@given(st.binary(max_size=200))
@OFFLINE
def test_random_bytes_files_give_a_config_or_a_config_error_naming_the_file(data: bytes) -> None:
    assert isinstance(_load(data), Config | ConfigError)


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("[routes]: 1\n", id="list-as-key-TypeError"),
        pytest.param("? {a: 1}\n: x\n", id="mapping-as-key-TypeError"),
        pytest.param("routes: " + "[" * 10_000 + "]" * 10_000 + "\n", id="deep-RecursionError"),
        pytest.param("shutdown_timeout: " + "9" * 5000 + "\n", id="5000-digits-ValueError"),
        pytest.param("shutdown_timeout: !!int 30s\n", id="tagged-int-ValueError"),
        pytest.param("shutdown_timeout: !!float ''\n", id="tagged-float-IndexError"),
        pytest.param("shutdown_timeout: !!int ''\n", id="tagged-int-IndexError"),
        pytest.param("leases: !!bool maybe\n", id="tagged-bool-KeyError"),
        pytest.param("listen: !!timestamp now\n", id="tagged-timestamp-AttributeError"),
        pytest.param("trusted_proxies: !!set [1]\n", id="tagged-set-TypeError"),
    ],
)
def test_yaml_pyyaml_cannot_construct_is_a_config_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "fenceproxy.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match=re.escape(str(path))):
        load_config(path)


EXAMPLE_CONFIG = Path(__file__).resolve().parent.parent / "config" / "example.yaml"
EXAMPLE_DATA: dict[str, Any] = yaml.safe_load(EXAMPLE_CONFIG.read_text(encoding="utf-8"))


def _locations(node: Any, at: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    """Every key and list item under ``node``, as paths from the top."""
    items: Any
    if isinstance(node, dict):
        items = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return []
    found = []
    for part, child in items:
        found.append((*at, part))
        found.extend(_locations(child, (*at, part)))
    return found


LOCATIONS = _locations(EXAMPLE_DATA)


def _dotted(location: tuple[str | int, ...]) -> str:
    """``("routes", 0, "upstream")`` to ``routes[0].upstream``, as ConfigError says it."""
    out = ""
    for part in location:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _within(inner: str, outer: str) -> bool:
    return inner == outer or inner.startswith((outer + ".", outer + "["))


MUTATION = st.tuples(
    st.sampled_from(LOCATIONS),
    st.one_of(st.none(), st.tuples(YAML_SCALAR)),  # None: delete; (value,): replace
)


@given(MUTATION)
@example((("leases", "prefix"), ("/billing",)))
@example((("routes", 1, "name"), ("billing",)))
@example((("routes", 0, "fence", "key_header"), ("fencing-job",)))
@example((("admin",), ("127.0.0.1:8080",)))
@example((("workers",), (2,)))  # with the example's SQLite store: refused, named
@OFFLINE
def test_one_key_changed_in_the_example_config_is_valid_or_an_error_naming_it(
    mutation: tuple[tuple[str | int, ...], tuple[Any] | None],
) -> None:
    location, replacement = mutation
    data = copy.deepcopy(EXAMPLE_DATA)
    parent = data
    for part in location[:-1]:
        parent = parent[part]
    if replacement is None:
        del parent[location[-1]]
    else:
        parent[location[-1]] = replacement[0]
    result = _load(yaml.safe_dump(data))
    if isinstance(result, Config):
        return
    changed = _dotted(location)
    for key, message in result.problems:
        if key == "":
            # A check across the whole file: it names the route, or the key it refuses
            # ("workers 3 ..." or "workers: 3 ...").
            named = message.startswith((f"{changed} ", f"{changed}: "))
            assert "route" in message or named, (changed, message)
        else:
            assert _within(changed, key) or _within(key, changed), (changed, key, message)


# --- 4. a model of one job's writes through the real proxy ----------------------------

PAYLOADS = [{"p": 1}, {"p": 2}]
WRITES = st.lists(
    st.tuples(
        st.integers(min_value=1, max_value=5),
        st.one_of(st.none(), st.sampled_from(["k1", "k2", "k3"])),
        st.sampled_from(range(len(PAYLOADS))),
    ),
    min_size=1,
    max_size=25,
)


@given(WRITES)
@NETWORK
@SHRINK_TIME
async def test_one_jobs_writes_match_a_model_of_the_fence_and_its_keys(
    proxy: Client,
    upstream: RecordingUpstream,
    writes: list[tuple[int, str | None, int]],
) -> None:
    """Sequential writes of a fresh job: the highest generation wins, a completed key
    with the same payload is replayed, with another payload is 422, a lower generation
    is 409; the upstream gets exactly the admitted writes, in order."""
    job = f"model-{next(_examples)}"
    before = len(upstream.received)
    highest: int | None = None
    completed: dict[str, int] = {}  # key -> payload index
    admitted: list[tuple[int, str | None, int]] = []
    for generation, key, payload in writes:
        response = await fenced(proxy, job, generation, key=key, body=PAYLOADS[payload])
        replayed = response.headers.get("Idempotent-Replayed") == "true"
        step = (generation, key, payload, response.status, await response.text())
        if key is not None and key in completed:
            if completed[key] == payload:
                assert (response.status, replayed) == (200, True), step
            else:
                assert response.status == 422, step
        elif highest is not None and generation < highest:
            assert response.status == 409, step
        else:
            assert (response.status, replayed) == (200, False), step
            highest = generation
            admitted.append((generation, key, payload))
            if key is not None:
                completed[key] = payload
    got = upstream.received[before:]
    assert [(r.job, r.generation, r.key, json.loads(r.body)) for r in got] == [
        (job, generation, key, PAYLOADS[payload]) for generation, key, payload in admitted
    ]
