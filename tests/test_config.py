"""The config file as users write it: the documented defaults, the accepted forms of
durations and sizes, and for each kind of mistake a ConfigError that names the file,
the key and what is wrong, through load_config, the CLI and the console script."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from fenceproxy import cli
from fenceproxy.config import (
    Config,
    FenceSpec,
    load_config,
    parse_listen,
)
from fenceproxy.errors import ConfigError
from fenceproxy.store.url import StoreURL, parse_store_url

from .postgres import PostgresServer

MINIMAL = """\
listen: 127.0.0.1:8080
store: sqlite:///fenceproxy.db
routes:
  - name: billing
    path: /billing/
    upstream: http://127.0.0.1:9000
"""


def one_route(
    extra: str = "",
    *,
    name: str = "billing",
    path: str = "/billing/",
    upstream: str = "http://127.0.0.1:9000",
    more_routes: str = "",
) -> str:
    """A ``routes:`` list whose first route gets ``extra`` (route-level YAML) added."""
    body = f"name: {name}\npath: {path}\nupstream: {upstream}\n" + textwrap.dedent(extra)
    return "routes:\n  - " + textwrap.indent(body, "    ").lstrip() + more_routes


def write(tmp_path: Path, text: str | bytes, name: str = "fenceproxy.yaml") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def config_error(path: Path, **kwargs: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, **kwargs)
    return str(info.value)


def assert_names(message: str, path: Path, key: str, phrase: str) -> None:
    """One line of ``message`` names the file, the dotted key and the problem together."""
    assert any(
        str(path) in line and f": {key}: " in line and phrase in line
        for line in message.splitlines()
    ), message


# --- what a valid file gives ---------------------------------------------------------


def test_minimal_file_gives_documented_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, MINIMAL))

    assert isinstance(config, Config)
    assert parse_listen(config.listen) == ("127.0.0.1", 8080)
    # A relative SQLite path is the config file's folder's, whatever the working directory.
    assert parse_store_url(config.store) == StoreURL(
        "sqlite", str(tmp_path / "fenceproxy.db"), "full"
    )
    assert config.trusted_proxies == ()
    assert config.idempotency.ttl == 86400.0
    assert config.idempotency.max_response == 1024 * 1024

    (route,) = config.routes
    assert (route.name, route.path, route.upstream) == (
        "billing",
        "/billing/",
        "http://127.0.0.1:9000",
    )
    assert route.timeout == 30.0
    assert route.connect_timeout == 5.0
    assert route.max_body == 10 * 1024 * 1024
    assert (route.paths, route.host) == ("refuse", "upstream")
    assert route.fence is not None
    assert route.fence.methods is None  # every method but the safe ones (SAFE_METHODS)
    assert route.fence.job_header == "Fencing-Job"
    assert route.fence.token_header == "Fencing-Token"
    assert route.fence.key_header == "Idempotency-Key"
    assert route.fence.scope_headers == ("Authorization", "Cookie")
    assert route.fence.on_duplicate == "replay"


def test_scope_headers_may_be_empty_for_keys_shared_by_every_caller(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, one_route("fence:\n  scope_headers: []\n")))
    assert config.routes[0].fence is not None
    assert config.routes[0].fence.scope_headers == ()


def test_listen_and_store_default_when_omitted(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, one_route()))
    assert config.listen == "127.0.0.1:8080"
    assert config.store == f"sqlite:///{tmp_path}/fenceproxy.db"


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("250ms", 0.25),
        ("30s", 30.0),
        ("5m", 300.0),
        ("24h", 86400.0),
        ("7d", 7 * 86400.0),
        ("1.5s", 1.5),
        ("45", 45.0),
        ("2.5", 2.5),
        ("'90'", 90.0),
    ],
)
def test_duration_forms_parse_to_seconds(tmp_path: Path, value: str, seconds: float) -> None:
    text = f"idempotency:\n  ttl: {value}\n" + one_route(f"timeout: {value}\n")
    config = load_config(write(tmp_path, text))
    assert config.routes[0].timeout == pytest.approx(seconds)
    assert config.idempotency.ttl == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("value", "size"),
    [
        ("512KiB", 512 * 1024),
        ("10MiB", 10 * 1024 * 1024),
        ("1GiB", 1024**3),
        ("64KB", 64_000),
        ("1024", 1024),
        ("'2048'", 2048),
    ],
)
def test_size_forms_parse_to_bytes(tmp_path: Path, value: str, size: int) -> None:
    text = f"idempotency:\n  max_response: {value}\n" + one_route(f"max_body: {value}\n")
    config = load_config(write(tmp_path, text))
    assert config.routes[0].max_body == size
    assert config.idempotency.max_response == size


def test_fence_false_makes_a_pass_through_route(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, one_route("fence: false\n")))
    assert config.routes[0].fence is None


def test_fence_true_means_the_default_fence(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, one_route("fence: true\n")))
    assert config.routes[0].fence == FenceSpec()


@pytest.mark.parametrize("path", ["/orders/{job}/", "/orders/{job}", "/{job}/items/"])
def test_job_placeholder_as_whole_segment_is_accepted(tmp_path: Path, path: str) -> None:
    config = load_config(write(tmp_path, one_route(path=path)))
    assert config.routes[0].path == path


# --- each mistake names the file, the key and the problem ----------------------------

SECOND_ROUTE = "  - name: {name}\n    path: {path}\n    upstream: http://127.0.0.1:9001\n"

BAD_FILES = [
    pytest.param(
        "listen: 127.0.0.1:8080\n", "routes", "at least one route is needed", id="missing-routes"
    ),
    pytest.param("routes: []\n", "routes", "(or leases: for a lease API alone)", id="empty-routes"),
    pytest.param(
        one_route(path="billing/"), "routes[0].path", "must start with /", id="path-no-slash"
    ),
    *(
        pytest.param(one_route(path=path), "routes[0].path", phrase, id=f"path-{path}")
        for path, phrase in [
            ("/billing//x/", "must not hold empty"),
            ("/billing/./x", "must not hold empty, '.' or '..'"),
            ("/a/../billing/", "must not hold empty, '.' or '..'"),
            ("/billing/..", "must not hold empty, '.' or '..'"),
            ("/caf%C3%A9/", "write the path decoded"),
            ("/billing;v=1/", "must not hold '%', ';'"),
            ("'/billing\\x/'", "a backslash"),
        ]
    ),
    pytest.param(
        one_route(upstream="ftp://files.example/"),
        "routes[0].upstream",
        "expected http://HOST",
        id="upstream-ftp",
    ),
    pytest.param(
        one_route(upstream="http://127.0.0.1:9000/?tenant=1"),
        "routes[0].upstream",
        "must not carry a query",
        id="upstream-query",
    ),
    pytest.param(
        one_route("fence:\n  methods: [POST, 'p t']\n"),
        "routes[0].fence.methods",
        "'p t' is not an HTTP method",
        id="not-a-method",
    ),
    pytest.param(
        "listne: 127.0.0.1:8080\n" + one_route(),
        "listne",
        "unknown key; did you mean 'listen'?",
        id="unknown-top-level-key",
    ),
    pytest.param(
        one_route("fence:\n  methodz: [POST]\n"),
        "routes[0].fence.methodz",
        "unknown key; did you mean 'methods'?",
        id="unknown-fence-key",
    ),
    pytest.param(
        "idempotency:\n  tll: 1h\n" + one_route(),
        "idempotency.tll",
        "unknown key; did you mean 'ttl'?",
        id="unknown-idempotency-key",
    ),
    pytest.param(
        one_route(more_routes=SECOND_ROUTE.format(name="billing", path="/other/")),
        "routes",
        "two routes have the name 'billing'",
        id="duplicate-route-names",
    ),
    pytest.param(
        one_route(more_routes=SECOND_ROUTE.format(name="other", path="/billing/")),
        "routes",
        "two routes have the path '/billing/'",
        id="duplicate-route-paths",
    ),
    pytest.param(
        "listen: '8080'\n" + one_route(), "listen", "expected HOST:PORT", id="listen-no-host"
    ),
    pytest.param(
        "listen: host:99999\n" + one_route(),
        "listen",
        "expected HOST:PORT",
        id="listen-port-out-of-range",
    ),
    pytest.param(
        "store: postgres://x\n" + one_route(),
        "store",
        "expected sqlite:///PATH",
        id="store-not-sqlite",
    ),
    pytest.param(
        "store: sqlite:///x.db?foo=1\n" + one_route(),
        "store",
        "the only store option is ?synchronous",
        id="store-unknown-option",
    ),
    pytest.param(
        one_route("timeout: 5x\n"),
        "routes[0].timeout",
        "expected seconds or a duration",
        id="duration-unknown-unit",
    ),
    pytest.param(
        one_route("timeout: -1\n"),
        "routes[0].timeout",
        "greater than 0",
        id="timeout-negative",
    ),
    pytest.param(
        one_route("connect_timeout: 0\n"),
        "routes[0].connect_timeout",
        "greater than 0",
        id="connect-timeout-zero",
    ),
    pytest.param(
        "idempotency:\n  ttl: 0s\n" + one_route(),
        "idempotency.ttl",
        "greater than 0",
        id="ttl-zero",
    ),
    pytest.param(
        one_route("max_body: 10 bananas\n"),
        "routes[0].max_body",
        "expected bytes or a size",
        id="size-unknown-unit",
    ),
    pytest.param(
        one_route(path="/orders/x{job}/"),
        "routes[0].path",
        "{job} must be a whole path segment",
        id="job-not-whole-segment",
    ),
    pytest.param(
        one_route("fence:\n  job_header: X-Fence\n  token_header: X-Fence\n"),
        "routes[0].fence",
        "must differ",
        id="identical-fence-headers",
    ),
    pytest.param(
        one_route("fence:\n  job_header: X-Fence\n  key_header: x-fence\n"),
        "routes[0].fence",
        "must differ",
        id="fence-headers-identical-but-for-case",
    ),
    pytest.param(
        one_route("fence:\n  key_header: Bad Header\n"),
        "routes[0].fence.key_header",
        "'Bad Header' is not a valid HTTP header name",
        id="header-name-with-space",
    ),
    pytest.param(
        one_route("paths: strict\n"),
        "routes[0].paths",
        "'refuse', 'normalize' or 'exact'",
        id="paths-unknown",
    ),
    pytest.param(
        one_route("host: client\n"),
        "routes[0].host",
        "'upstream' or 'preserve'",
        id="host-unknown",
    ),
    pytest.param(
        one_route("fence:\n  scope_headers: Authorization\n"),
        "routes[0].fence.scope_headers",
        "expected a list of header names",
        id="scope-headers-not-a-list",
    ),
    pytest.param(
        one_route("fence:\n  scope_headers: [Authorization, X Api Key]\n"),
        "routes[0].fence.scope_headers",
        "'X Api Key' is not a valid HTTP header name",
        id="scope-header-name-with-space",
    ),
    pytest.param(
        one_route("fence:\n  scope_headers: [Cookie, cookie]\n"),
        "routes[0].fence.scope_headers",
        "a header is named twice",
        id="scope-header-twice",
    ),
    pytest.param(
        one_route("fence:\n  scope_headers: [Authorization, idempotency-key]\n"),
        "routes[0].fence",
        "scope_headers must not name the job, token or key header",
        id="scope-header-is-a-fencing-field",
    ),
    pytest.param(
        "trusted_proxies: [10.0.0.0/8, proxy.internal]\n" + one_route(),
        "trusted_proxies",
        "'proxy.internal' is not an IP address or network",
        id="trusted-proxy-not-an-ip",
    ),
]


@pytest.mark.parametrize(("text", "key", "phrase"), BAD_FILES)
def test_bad_file_error_names_file_key_and_problem(
    tmp_path: Path, text: str, key: str, phrase: str
) -> None:
    path = write(tmp_path, text)
    assert_names(config_error(path), path, key, phrase)


def test_every_problem_in_a_file_is_reported_at_once(tmp_path: Path) -> None:
    path = write(tmp_path, "listen: x\nstore: y\n" + one_route(upstream="ftp://x/"))
    message = config_error(path)
    assert_names(message, path, "listen", "expected HOST:PORT")
    assert_names(message, path, "store", "expected sqlite:///PATH")
    assert_names(message, path, "routes[0].upstream", "expected http://HOST")


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    text = (
        "listen: 127.0.0.1:8080\n"
        "routes:\n"
        "  - name: billing\n"
        "    path: /billing/\n"
        "    fence: {methods: [POST}\n"  # line 5: the bracket is never closed
        "    upstream: http://127.0.0.1:9000\n"
    )
    path = write(tmp_path, text)
    message = config_error(path)
    assert str(path) in message
    assert "line 5" in message
    assert "invalid YAML" in message


@pytest.mark.parametrize(
    ("content", "phrase"),
    [
        pytest.param("- name: billing\n- name: other\n", "top level must be a mapping", id="list"),
        pytest.param("just a string\n", "top level must be a mapping", id="scalar"),
        pytest.param("", "top level must be a mapping", id="empty-file"),
        pytest.param(b"listen: 127.0.0.1:8080\n# caf\xe9 in Latin-1\n", "utf-8", id="not-utf-8"),
    ],
)
def test_unusable_file_error_names_file(tmp_path: Path, content: str | bytes, phrase: str) -> None:
    path = write(tmp_path, content)
    message = config_error(path)
    assert str(path) in message
    assert phrase in message


def test_missing_file_error_names_file(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.yaml"
    message = config_error(path)
    assert str(path) in message
    assert "cannot read" in message
    assert "No such file" in message


# --- messages for common slips -------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("routes: 5\n", id="routes-not-a-list"),
        pytest.param(one_route("fence:\n  methods: POST\n"), id="methods-not-a-list"),
        pytest.param("trusted_proxies: 10.0.0.0/8\n" + one_route(), id="proxies-not-a-list"),
    ],
)
def test_list_errors_say_list(tmp_path: Path, text: str) -> None:
    message = config_error(write(tmp_path, text))
    assert "tist" not in message.lower()
    assert "list" in message.lower()


def test_listen_bare_port_number_hints_host_port(tmp_path: Path) -> None:
    path = write(tmp_path, "listen: 8080\n" + one_route())
    assert_names(config_error(path), path, "listen", "expected HOST:PORT")


def test_unknown_key_with_brackets_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, "routes[0]:\n  timeout: 5s\n" + one_route())
    assert_names(config_error(path), path, "routes[0]", "unknown key; did you mean 'routes'?")


@pytest.mark.parametrize("setting", ["timeout: yes", "max_body: on"])
def test_boolean_where_a_number_is_expected_is_refused(tmp_path: Path, setting: str) -> None:
    path = write(tmp_path, one_route(setting + "\n"))
    key = "routes[0]." + setting.split(":")[0]
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert f": {key}: " in str(info.value)


# --- command-line overrides ----------------------------------------------------------


def test_overrides_take_precedence_over_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL)
    config = load_config(
        path, overrides={"listen": "[::1]:9999", "store": "sqlite:////var/lib/fences.db"}
    )
    assert parse_listen(config.listen) == ("::1", 9999)
    assert parse_store_url(config.store).path == "/var/lib/fences.db"


@pytest.mark.parametrize(
    ("key", "value", "phrase"),
    [
        ("listen", "8080", "expected HOST:PORT"),
        ("store", "postgres://x", "expected sqlite:///PATH"),
    ],
)
def test_bad_override_is_reported_as_the_option(
    tmp_path: Path, key: str, value: str, phrase: str
) -> None:
    path = write(tmp_path, MINIMAL)
    message = config_error(path, overrides={key: value})
    assert str(path) in message
    assert f"--{key}" in message
    assert phrase in message


# --- the CLI -------------------------------------------------------------------------


@pytest.fixture
def no_serve(monkeypatch: pytest.MonkeyPatch) -> list[Config]:
    """Replace the server start with a recorder: the tests never bind a port."""
    served: list[Config] = []
    monkeypatch.setattr(cli, "_serve", lambda config, *_: served.append(config) or 0)
    return served


def test_check_config_good_file_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, MINIMAL)
    assert cli.main(["check-config", "-c", str(path)]) == 0
    out, err = capsys.readouterr()
    assert str(path) in out
    assert "OK" in out
    assert err == ""


@pytest.mark.parametrize(
    ("text", "key", "phrase"),
    [
        pytest.param(
            one_route(upstream="ftp://files.example/"),
            "routes[0].upstream",
            "expected http://HOST",
            id="bad-key",
        ),
        pytest.param(
            one_route("fence:\n  methodz: [POST]\n"),
            "routes[0].fence.methodz",
            "did you mean 'methods'?",
            id="typo",
        ),
    ],
)
def test_check_config_bad_file_exits_2_naming_file_key_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, key: str, phrase: str
) -> None:
    path = write(tmp_path, text)
    assert cli.main(["check-config", "-c", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert_names(err, path, key, phrase)
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "content",
    [
        pytest.param("routes:\n  - name: [billing\n", id="yaml-syntax"),
        pytest.param(b"\xff\xfe\x00", id="not-utf-8"),
    ],
)
def test_check_config_unreadable_file_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | bytes
) -> None:
    path = write(tmp_path, content)
    assert cli.main(["check-config", "-c", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err
    assert "Traceback" not in err


def test_check_config_missing_file_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "nowhere.yaml"
    assert cli.main(["check-config", "-c", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err
    assert "Traceback" not in err


def test_serve_bad_file_exits_2_without_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_serve: list[Config]
) -> None:
    path = write(tmp_path, one_route(path="billing/"))
    assert cli.main(["serve", "-c", str(path)]) == 2
    assert no_serve == []
    err = capsys.readouterr().err
    assert_names(err, path, "routes[0].path", "must start with /")
    assert "Traceback" not in err


def test_serve_bad_listen_option_exits_2_naming_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_serve: list[Config]
) -> None:
    path = write(tmp_path, MINIMAL)
    assert cli.main(["serve", "-c", str(path), "--listen", "8080"]) == 2
    assert no_serve == []
    err = capsys.readouterr().err
    assert "--listen" in err
    assert "expected HOST:PORT" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("text", "key", "suggestion"),
    [
        ("upstreem: http://127.0.0.1:9\n", "routes[0].upstreem", "upstream"),
        ("fence:\n  check_leases: true\n", "routes[0].fence.check_leases", "check_lease"),
    ],
)
def test_an_unknown_key_names_the_closest_known_one(
    tmp_path: Path, text: str, key: str, suggestion: str
) -> None:
    path = write(tmp_path, one_route(text))
    assert_names(config_error(path), path, key, f"unknown key; did you mean {suggestion!r}?")


def test_limits_typo_names_the_closest_key(tmp_path: Path) -> None:
    path = write(tmp_path, "limits:\n  max_conections: 5\n" + one_route())
    assert_names(config_error(path), path, "limits.max_conections", "'max_connections'")


def test_serve_options_override_the_file(tmp_path: Path, no_serve: list[Config]) -> None:
    path = write(tmp_path, MINIMAL)
    store = f"sqlite:///{tmp_path / 'other.db'}"
    argv = ["serve", "-c", str(path), "--listen", "127.0.0.1:9191", "--store", store]
    assert cli.main(argv) == 0
    (config,) = no_serve
    assert config.listen == "127.0.0.1:9191"
    assert config.store == store


@pytest.mark.slow
def test_console_script_bad_file_exits_2_with_message(tmp_path: Path) -> None:
    path = write(tmp_path, one_route(upstream="ftp://files.example/"))
    result = subprocess.run(
        [sys.executable, "-m", "fenceproxy", "check-config", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert_names(result.stderr, path, "routes[0].upstream", "expected http://HOST")
    assert "Traceback" not in result.stderr


def test_a_key_given_twice_is_refused_with_its_line(tmp_path: Path) -> None:
    path = write(tmp_path, one_route() + one_route())
    message = config_error(path)
    assert str(path) in message
    assert "'routes' is given twice" in message
    assert "line " in message


def test_the_example_configs_are_valid() -> None:
    root = Path(__file__).parent.parent / "config"
    examples = sorted(root.glob("*.yaml"))
    assert examples
    for example in examples:
        assert load_config(example).routes


# What the driver is given besides the URL's own options: connections to a primary
# only, named in pg_stat_activity.
DRIVER = "application_name=fenceproxy&target_session_attrs=read-write"


@pytest.mark.parametrize(
    ("value", "dsn", "pool", "password_env", "where"),
    [
        (
            "postgresql://fp@db:5432/fences",
            f"postgresql://fp@db:5432/fences?{DRIVER}",
            10,
            None,
            "db:5432/fences",
        ),
        ("postgres://fp@db/fences?pool=3", f"postgresql://fp@db/fences?{DRIVER}", 3, None, "db/"),
        (
            "postgresql://fp@db/f?password_env=FP_PW&sslmode=require",
            f"postgresql://fp@db/f?sslmode=require&{DRIVER}",
            10,
            "FP_PW",
            "db/f",
        ),
        (  # a Patroni cluster: the driver tries the hosts in turn for the primary
            "postgresql://fp@db1:5432,db2:5433,[fd00::3]/f?target_session_attrs=primary",
            "postgresql://fp@db1:5432,db2:5433,[fd00::3]/f"
            "?target_session_attrs=primary&application_name=fenceproxy",
            10,
            None,
            "db1:5432,db2:5433,[fd00::3]/f",
        ),
    ],
)
def test_postgres_store_urls(
    value: str, dsn: str, pool: int, password_env: str | None, where: str
) -> None:
    url = parse_store_url(value)
    assert (url.backend, url.dsn, url.pool, url.password_env, url.require_sync) == (
        "postgresql",
        dsn,
        pool,
        password_env,
        False,
    )
    assert f"PostgreSQL database {where}" in url.describe()


def test_require_sync_is_the_stores_own_option() -> None:
    url = parse_store_url("postgresql://fp@db1,db2/f?require_sync=true")
    assert url.require_sync
    assert "require_sync" not in url.dsn


@pytest.mark.parametrize(
    ("value", "phrase"),
    [
        ("postgresql://fp:secret@db/f", "must not be written into the config"),
        ("postgresql://fp:secret@db1,db2/f", "must not be written into the config"),
        ("postgresql://fp@db/f?pool=0", "?pool= takes a number"),
        ("postgresql://fp@db/f?password_env=1-x", "?password_env= takes the name"),
        ("postgresql://fp@db", "expected sqlite:///PATH"),
        ("postgresql://fp@db1:5432,db2:port/f", "'db2:port' is not a host"),
        ("postgresql://fp@db1,/f", "'' is not a host"),
        ("postgresql://fp@db1:70000/f", "'db1:70000' is not a host"),
        ("postgresql://fp@db1,db2/f?target_session_attrs=any", "must be read-write or primary"),
        ("postgresql://fp@db/f?target_session_attrs=standby", "must be read-write or primary"),
        ("postgresql://fp@db/f?require_sync=yes", "?require_sync= takes true or false"),
    ],
)
def test_bad_postgres_store_urls_are_config_errors(tmp_path: Path, value: str, phrase: str) -> None:
    path = write(tmp_path, f"store: '{value}'\n" + one_route())
    message = config_error(path)
    assert_names(message, path, "store", phrase)
    assert "secret" not in message


@pytest.mark.parametrize(
    ("store", "said"),
    [
        (
            "sqlite:////nowhere/fences.db",
            "cannot open SQLite store '/nowhere/fences.db': its folder '/nowhere' does not exist",
        ),
        ("postgresql://u@127.0.0.1:9/x", "cannot connect to the PostgreSQL store 127.0.0.1:9/x"),
        (None, "cannot listen on 127.0.0.1:{port}: address already in use"),
    ],
    ids=["sqlite-folder-missing", "postgres-unreachable", "port-in-use"],
)
def test_serve_that_cannot_start_says_what_and_where_in_one_line_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], store: str | None, said: str
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        store = store or f"sqlite:///{tmp_path / 'fences.db'}"
        path = write(tmp_path, f"listen: 127.0.0.1:{port}\nstore: {store}\n" + one_route())
        assert cli.main(["serve", "-c", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"fenceproxy: cannot start: {said.format(port=port)}" in err
    assert "Traceback" not in err
    assert "fenceproxy on http" not in err  # it never said it was serving


@pytest.mark.parametrize(
    ("store", "said"),
    [
        ("sqlite:////nowhere/fences.db", "store: SQLite store '/nowhere/fences.db': its folder"),
        ("postgresql://u@127.0.0.1:9/x", "store: cannot connect to the PostgreSQL store"),
    ],
    ids=["sqlite-folder-missing", "postgres-unreachable"],
)
def test_check_config_checks_the_store_without_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], store: str, said: str
) -> None:
    path = write(tmp_path, f"store: {store}\n" + one_route())
    assert cli.main(["check-config", "-c", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"fenceproxy: {path}: {said}" in err
    assert "Traceback" not in err


def test_check_config_passes_a_migrated_postgres_database(
    tmp_path: Path, postgres: PostgresServer, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, f"store: {postgres.url('fenceproxy')}\n" + one_route())
    assert cli.main(["check-config", "-c", str(path)]) == 0
    assert "OK, 1 route(s)" in capsys.readouterr().out


def test_methods_are_written_in_any_case(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, one_route("fence:\n  methods: [post, Put, POST]\n")))
    assert config.routes[0].fence is not None
    assert config.routes[0].fence.methods == ("POST", "PUT")


def test_a_proxy_may_serve_its_lease_api_alone(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "leases: {}\nroutes: []\n"))
    assert (config.routes, config.leases is not None) == ((), True)
    assert load_config(write(tmp_path, "leases: {}\n")).routes == ()
