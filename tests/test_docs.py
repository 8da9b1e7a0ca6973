"""Every code block that README.md and docs/ show is checked, so the documentation
cannot drift from the code unnoticed:

* ``yaml``: loaded and validated by the config loader, as ``serve`` loads a file; a
  block marked ``<!-- fragment: why -->`` is merged into the minimal config. The
  secrets a block names are made for the test, and absolute paths are moved under
  a temporary folder;
* ``python``: compiled here, and run against a real proxy in tests/test_examples.py
  unless marked a fragment. That file also runs the README's quick start: its
  commands sent to a real proxy in order, the answers compared with the JSON shown;
* ``sh`` and ``console``: each ``fenceproxy`` command parsed by the command line's own
  parser, each ``make`` target found in the Makefile, each script named found, each
  JSON body curl sends parsed;
* ``json``: parsed; ``http``: a request line, header fields, and a JSON body parsed;
* ``js`` and ``java``: excerpts of examples/worker.mjs and examples/Worker.java (which
  tests/test_examples.py runs), each line found there, in the same order;
* ``text``: shown (logs and output); only the names in it are checked, below;
* ``mermaid``: a diagram, drawn in a real browser from the built site, offline; a state
  diagram is drawn from its table by docs/diagrams.py, and must be what it draws now.

A block marked ``<!-- skip: why -->`` is not checked. Also: README.md stays a front
page (250 lines at most), every relative link points to a file that exists (and an
anchor to a heading there), and mkdocs.yml's nav lists every page.

And every name the pages write exists, in README.md, docs/ and THREAT_MODEL.md: each
file, module and test they send the reader to, each logger (fenceproxy/log.py's),
each config key with the value it is given (fenceproxy/config.py's schema) and each
metric (what the package defines, as Prometheus writes its samples). A failure names
the file, the line and the name.
"""

from __future__ import annotations

import ast
import base64
import collections
import hashlib
import importlib
import importlib.util
import itertools
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from fenceproxy import cli, log
from fenceproxy.config import Config, load_config
from fenceproxy.ops.tracing import ATTRIBUTES

from .certs import Certificates

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Whose names and links are checked too: the threat model sends readers to code and tests.
NAMED_PAGES = [*PAGES, ROOT / "THREAT_MODEL.md"]
LANGUAGES = {"yaml", "python", "sh", "console", "json", "http", "text", "js", "java", "mermaid"}
README_MAX_LINES = 250

# What a fragment is merged into: config/minimal.yaml, as the docs show it.
MINIMAL: dict[str, Any] = yaml.safe_load((ROOT / "config" / "minimal.yaml").read_text())

FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+)(?P<lang>[\w-]*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*(?P<kind>fragment|skip):\s*(?P<why>.*?)\s*-->\s*$")
ANY_MARKER = re.compile(r"^\s*<!--\s*(fragment|skip)\b")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # the opening fence's, from 1
    lang: str
    code: str
    marker: str | None  # "fragment", "skip" or None
    why: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def code_blocks(pages: list[Path] = PAGES) -> list[Block]:
    """Every fenced code block of ``pages``, dedented to its fence, with the marker
    on the line before it, if any."""
    blocks = []
    for path in pages:
        lines = path.read_text().split("\n")
        n = 0
        while n < len(lines):
            opening = FENCE.match(lines[n])
            if opening is None:
                n += 1
                continue
            indent, fence = len(opening["indent"]), opening["fence"]
            end = n + 1
            while end < len(lines) and lines[end].strip() != fence:
                end += 1
            assert end < len(lines), f"{path.name}:{n + 1}: a code block is never closed"
            marker = MARKER.match(lines[n - 1]) if n else None
            code = "\n".join(line[indent:] for line in lines[n + 1 : end]) + "\n"
            blocks.append(
                Block(
                    path,
                    n + 1,
                    opening["lang"],
                    code,
                    marker["kind"] if marker else None,
                    marker["why"] if marker else "",
                )
            )
            n = end + 1
    return blocks


BLOCKS = code_blocks()


def blocks_of(*langs: str) -> Any:
    """A parametrization over the blocks of ``langs``, named by file and line."""
    chosen = [b for b in BLOCKS if b.lang in langs]
    return pytest.mark.parametrize("block", chosen, ids=[b.where for b in chosen])


def test_the_pages_have_code_blocks_of_every_kind_checked() -> None:
    langs = {b.lang for b in BLOCKS}
    assert langs <= LANGUAGES, [(b.where, b.lang) for b in BLOCKS if b.lang not in LANGUAGES]
    assert {"yaml", "python", "sh", "json"} <= langs


def test_every_marker_stands_before_a_block_and_says_why() -> None:
    for path in PAGES:
        lines = path.read_text().split("\n")
        for n, line in enumerate(lines):
            if not ANY_MARKER.match(line):
                continue
            where = f"{path.relative_to(ROOT)}:{n + 1}"
            marker = MARKER.match(line)
            assert marker is not None, f"{where}: <!-- fragment: why --> or <!-- skip: why -->"
            assert marker["why"], f"{where}: a marker says why"
            following = lines[n + 1] if n + 1 < len(lines) else ""
            assert FENCE.match(following), f"{where}: a marker stands just before its block"


# --- YAML: the config loader ------------------------------------------------------


def _secret() -> str:
    """A signing key and a lease credential alike: 32 random bytes, base64url."""
    return base64.urlsafe_b64encode(os.urandom(32)).rstrip(b"=").decode()


def _secrets(data: Any) -> Iterator[dict[str, Any]]:
    """Every secret a config names: signing keys, lease API clients and the headers
    sent with traces."""
    if not isinstance(data, dict):
        return
    for section, key in (("signing", "keys"), ("leases", "clients")):
        if isinstance(data.get(section), dict):
            yield from data[section].get(key) or []
    yield from data.get("admin_clients") or []
    if isinstance(data.get("tracing"), dict):
        headers = data["tracing"].get("headers") or {}
        yield from (value for value in headers.values() if isinstance(value, dict))


def _make_tls_files(data: dict[str, Any], folder: Path) -> None:
    """Every certificate, key and CA file a config names, made by a CA of the test's."""
    routes = data.get("routes") or []
    specs = [data.get("tls"), data.get("admin_tls"), *(r.get("tls") for r in routes)]
    specs = [spec for spec in specs if isinstance(spec, dict)]
    if not specs:
        return
    certs = Certificates(folder / ".made-for-the-test")
    chain, key = certs.server()
    for spec in specs:
        made = {"cert": chain, "key": key, "client_ca": certs.ca_file, "ca": certs.ca_file}
        for name, source in made.items():
            if spec.get(name):
                file = folder / spec[name]  # an absolute path stays itself
                file.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(source, file)


@blocks_of("yaml")
def test_a_yaml_block_is_a_config_the_loader_takes(
    block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if block.marker == "skip":
        pytest.skip(f"{block.where}: {block.why}")
    # Absolute paths (secrets, the folder for bodies) go under the temporary folder.
    text = re.sub(r"(?<=[\s:'\"])/(etc|var|opt|srv|run)/", f"{tmp_path}/\\1/", block.code)
    data = yaml.safe_load(text)
    assert isinstance(data, dict), f"{block.where}: a config is a mapping of keys"
    if block.marker == "fragment":
        # The fragment as written, after what of the minimal config it leaves alone.
        rest = {key: value for key, value in MINIMAL.items() if key not in data}
        text = yaml.safe_dump(rest, sort_keys=False) + text
        data = {**rest, **data}
    for secret in _secrets(data):
        if secret.get("env"):
            monkeypatch.setenv(secret["env"], _secret())
        if secret.get("file"):
            file = tmp_path / secret["file"]  # an absolute path stays itself
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(_secret() + "\n")
    _make_tls_files(data, tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the default folder for bodies
    config_file = tmp_path / "fenceproxy.yaml"
    config_file.write_text(text)
    load_config(config_file)  # ConfigError, naming the key, when the block is not valid


# --- Python: compiled here, run in tests/test_examples.py ---------------------------


@blocks_of("python")
def test_a_python_block_compiles(block: Block) -> None:
    if block.marker == "skip":
        pytest.skip(f"{block.where}: {block.why}")
    compile(block.code, block.where, "exec")


# --- Shell: the command line's own parser, the Makefile, the scripts ---------------


def commands(block: Block) -> list[list[str]]:
    """The commands of a ``sh`` block, or of a ``console`` block's ``$`` lines, each
    split as the shell would (comments dropped, ``\\`` continuations joined, ``&&``
    and ``|`` apart)."""
    lines = block.code.splitlines()
    if block.lang == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    text = "\n".join(lines).replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        argv: list[str] = []
        for word in shlex.split(line, comments=True):
            if word in ("&&", "||", "|", ";"):
                found.append(argv)
                argv = []
            else:
                argv.append(word)
        found.append(argv)
    return [argv for argv in found if argv]


class _Parsed(Exception):
    """The chaos command parsed its arguments and would start its run now."""


def _parse_fenceproxy(argv: list[str], where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if argv[:1] == ["chaos"]:
        from fenceproxy import chaos

        def parsed(*_: Any, **__: Any) -> Any:
            raise _Parsed

        monkeypatch.setattr(chaos, "run_chaos", parsed)
        with pytest.raises(_Parsed):
            try:
                chaos.main(argv[1:])
            except SystemExit as exc:
                pytest.fail(f"{where}: fenceproxy {shlex.join(argv)}: usage error ({exc})")
        return
    parser, _ = cli._parser()
    try:
        parser.parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{where}: fenceproxy {shlex.join(argv)}: usage error ({exc})")


def _make_targets() -> set[str]:
    makefile = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w.-]*):(?!=)", makefile, re.M))


def _check_curl(argv: list[str], where: str) -> None:
    """A JSON body curl sends is JSON."""
    json_body = any("application/json" in word for word in argv)
    for flag, value in itertools.pairwise(argv):
        if flag in ("-d", "--data", "--data-raw") and json_body:
            try:
                json.loads(value)
            except ValueError as exc:
                pytest.fail(f"{where}: curl sends a body that is not JSON: {value} ({exc})")


@blocks_of("sh", "console")
def test_a_shell_block_runs_commands_that_exist(
    block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    if block.marker == "skip":
        pytest.skip(f"{block.where}: {block.why}")
    argvs = commands(block)
    assert argvs, f"{block.where}: no command"
    for argv in argvs:
        while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
            argv = argv[1:]  # VAR=value before a command
        program = os.path.basename(argv[0])
        if program == "fenceproxy":
            _parse_fenceproxy(argv[1:], block.where, monkeypatch)
        elif program.startswith("python") and argv[1:3] == ["-m", "fenceproxy"]:
            _parse_fenceproxy(argv[3:], block.where, monkeypatch)
        elif program in ("node", "java") and len(argv) > 1:
            assert (ROOT / argv[1]).is_file(), f"{block.where}: no program {argv[1]}"
        elif program.startswith("python") and len(argv) > 1 and argv[1].endswith(".py"):
            assert (ROOT / argv[1]).is_file(), f"{block.where}: no script {argv[1]}"
        elif program == "make":
            targets = [word for word in argv[1:] if "=" not in word]
            missing = set(targets) - _make_targets()
            assert not missing, f"{block.where}: no make target {', '.join(sorted(missing))}"
        elif program == "curl":
            _check_curl(argv, block.where)


# --- JSON and HTTP ------------------------------------------------------------------


@blocks_of("json")
def test_a_json_block_parses(block: Block) -> None:
    if block.marker == "skip":
        pytest.skip(f"{block.where}: {block.why}")
    try:
        json.loads(block.code)
    except ValueError as exc:
        pytest.fail(f"{block.where}: {exc}")


@blocks_of("http")
def test_an_http_block_is_a_request(block: Block) -> None:
    if block.marker == "skip":
        pytest.skip(f"{block.where}: {block.why}")
    head, _, body = block.code.partition("\n\n")
    request_line, *fields = head.splitlines()
    assert re.fullmatch(r"[A-Z]+ /\S* HTTP/1\.[01]", request_line), block.where
    names = []
    for field in fields:
        match = re.fullmatch(r"([!#$%&'*+.^_`|~0-9A-Za-z-]+): (\S.*)", field)
        assert match is not None, f"{block.where}: not a header field: {field!r}"
        names.append(match[1].lower())
    assert len(names) == len(set(names)), f"{block.where}: a field given twice"
    if body.strip() and "content-type" in names:
        json.loads(body)


# --- JavaScript and Java: excerpts of the examples that run -------------------------

EXCERPTED = {"js": ROOT / "examples" / "worker.mjs", "java": ROOT / "examples" / "Worker.java"}


@blocks_of(*EXCERPTED)
def test_a_js_or_java_block_is_an_excerpt_of_its_example(block: Block) -> None:
    """A ``js`` or ``java`` block shows lines of the example that tests/test_examples.py
    runs, in its order (indented as the excerpt needs; a line ``// ...`` stands for
    lines left out): what a page shows is what was tested."""
    if block.marker == "skip":
        pytest.skip(f"{block.where}: {block.why}")
    source = [line.strip() for line in EXCERPTED[block.lang].read_text().splitlines()]
    at = 0
    for n, line in enumerate(block.code.splitlines(), block.line + 1):
        if line.strip() in ("", "// ..."):
            continue
        try:
            at = source.index(line.strip(), at) + 1
        except ValueError:
            name = EXCERPTED[block.lang].relative_to(ROOT)
            pytest.fail(f"{block.path.name}:{n}: not in {name} (after the lines before it)")


# --- The pages as a whole -----------------------------------------------------------


def test_the_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the rest goes to docs/"
    opening = next(b for b in BLOCKS if b.path.name == "README.md")
    assert opening.line <= 3, "README.md opens with the commands that work on a fresh machine"
    assert [argv[:2] for argv in commands(opening)] == [["make", "demo"], ["make", "test"]]


def _slugs(page: Path) -> set[str]:
    """The anchors of a page's headings, as both GitHub and MkDocs make them: a link
    to a heading must work on either."""
    github, mkdocs = set(), set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", _prose(page), re.M):
        text = re.sub(r"[`*]", "", heading).strip().lower()
        github.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
        mkdocs.add(re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text)).strip("-"))
    return github & mkdocs


def _prose_lines(page: Path) -> list[str]:
    """A page's lines, those of its code blocks left blank, so each keeps its number."""
    lines = page.read_text().split("\n")
    for block in code_blocks([page]):
        closing = block.line + block.code.count("\n")  # the closing fence's index
        lines[block.line - 1 : closing + 1] = [""] * (closing - block.line + 2)
    return lines


def _prose(page: Path) -> str:
    """A page without its code blocks."""
    return "\n".join(_prose_lines(page))


def test_every_relative_link_points_to_a_file_and_heading_that_exist() -> None:
    broken = []
    for page in NAMED_PAGES:
        prose = re.sub(r"`[^`\n]*`", "", _prose(page))  # not in inline code either
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue  # https:, mailto:
            file, _, anchor = target.partition("#")
            linked = (page.parent / file).resolve() if file else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not linked.exists():
                broken.append(f"{where}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in _slugs(linked):
                broken.append(f"{where}: no such heading in {linked.name}")
    assert not broken, "\n".join(broken)


def test_the_site_lists_every_page_in_its_nav() -> None:
    def pages(nav: Any) -> Iterator[str]:
        for entry in nav:
            for value in entry.values() if isinstance(entry, dict) else [entry]:
                if isinstance(value, list):
                    yield from pages(value)
                else:
                    yield value

    site = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = list(pages(site["nav"]))
    assert len(listed) == len(set(listed))
    assert sorted(listed) == sorted(p.name for p in PAGES if p.parent.name == "docs")


# --- Names: files, modules, tests, loggers, config keys, metrics ---------------------


def _where(page: Path, line: int) -> str:
    return f"{page.relative_to(ROOT)}:{line}"


def _spans(page: Path) -> Iterator[tuple[int, str, list[str]]]:
    """Each line of a page's prose that has inline code: its number, the line, and
    the spans."""
    for n, line in enumerate(_prose_lines(page), 1):
        spans = re.findall(r"`([^`\n]+)`", line)
        if spans:
            yield n, line, spans


# The repository's folders whose files the pages name, and the endings of file names.
FOLDERS = ("fenceproxy", "tests", "bench", "examples", "model", "deploy", "requirements",
           "config", "docs")  # fmt: skip
FILE_PATH = re.compile(rf"(?<![\w./~-])(?:{'|'.join(FOLDERS)})/[\w./-]*")
MODULE_FILE = re.compile(r"(?:[a-z_]\w*/)*[a-z_]\w*\.py")
TEST_ID = re.compile(r"(?P<file>[\w/.-]+\.py)?::(?P<name>\w+)(?:\[.*\])?")
DOTTED = re.compile(r"(?<![\w./-])fenceproxy(?:\.[A-Za-z_]\w*)+")
FILE_SUFFIX = re.compile(r"\.(?:ya?ml|json|toml|lock|md|py|pml|db|service|env|key|secret)$")


def _defined(file: Path) -> set[str]:
    """The functions and classes a Python file defines, at any depth."""
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return {node.name for node in ast.walk(ast.parse(file.read_text())) if isinstance(node, kinds)}


def _a_module(file: str) -> bool:
    """Whether a module named by its file alone or within the package (``turn.py``,
    ``http/target.py``) is one of the repository's. A path from the top is checked
    as a path."""
    if file.startswith(tuple(f"{folder}/" for folder in FOLDERS)):
        return True
    return any(any(ROOT.glob(f"{folder}/**/{file}")) for folder in FOLDERS)


def _resolves(name: str) -> bool:
    """Whether a dotted name is a module of the package, or an attribute of one. A
    module is found without being run (``fenceproxy.__main__`` would start it)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        module = ".".join(parts[:n])
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # under a module that is no package
            found = False
        if found:
            value: Any = importlib.import_module(module) if parts[n:] else None
            for attr in parts[n:]:
                if not hasattr(value, attr):
                    return False
                value = getattr(value, attr)
            return True
    return False


def test_every_file_module_and_test_the_pages_name_exists() -> None:
    """A file (``fenceproxy/fence/write.py``, ``deploy/ha/``), a module by its file or
    dotted name, a test (``tests/test_x.py::test_y``) that a page sends its reader to
    is there: a module renamed or a test rewritten leaves no page pointing at nothing."""
    broken = []
    for page in NAMED_PAGES:
        for n, _, spans in _spans(page):
            where, last_file = _where(page, n), None
            for span in spans:
                for path in FILE_PATH.findall(span):
                    if not (ROOT / path).exists():
                        broken.append(f"{where}: `{path}`: no such file")
                if MODULE_FILE.fullmatch(span) and not _a_module(span):
                    broken.append(f"{where}: `{span}`: no such module")
                if test := TEST_ID.fullmatch(span):
                    file = test["file"] or last_file  # `::test_y` after `tests/test_x.py`
                    if file is None or not (ROOT / file).is_file():
                        broken.append(f"{where}: `{span}`: no file holds this test")
                    elif test["name"] not in _defined(ROOT / file):
                        broken.append(f"{where}: `{span}`: {file} defines no {test['name']}")
                    last_file = file
                elif span.endswith(".py"):
                    last_file = span
        for n, line in enumerate(page.read_text().split("\n"), 1):
            for name in DOTTED.findall(line):  # prose and code blocks alike
                known = LOGGERS | ATTRIBUTES  # a logger, or an attribute of the traces
                if not FILE_SUFFIX.search(name) and name not in known and not _resolves(name):
                    broken.append(f"{_where(page, n)}: `{name}`: no such module or attribute")
    assert not broken, "\n".join(broken)


LOGGERS = {value.name for value in vars(log).values() if isinstance(value, logging.Logger)}
LEVEL = "DEBUG|INFO|WARNING|ERROR|CRITICAL"
LOG_LINE = re.compile(rf"^\S+ \S+ (?:{LEVEL}) (?P<text>\S+) |\"logger\": \"(?P<json>[^\"]+)\"")
LOGGER_SPAN = re.compile(rf"(?P<logger>\w+(?:\.\w+)+)(?P<level>: (?:{LEVEL}))?")


def _levels(data: Any) -> list[str]:
    """The loggers a config's ``log_levels`` names."""
    levels = data.get("log_levels") if isinstance(data, dict) else None
    return list(levels) if isinstance(levels, dict) else []


def test_every_logger_the_pages_name_is_one_the_proxy_logs_to() -> None:
    """Where a page names a logger (a key of ``log_levels``, the logger of a log line
    shown, a dotted name beside the word logger or given a level), it is one of
    fenceproxy/log.py's: an operator who sets its level sees its lines change."""
    named: list[tuple[str, str]] = []  # (where, logger)
    for page in NAMED_PAGES:
        for n, line, spans in _spans(page):
            about_loggers = "logger" in line.lower()
            for span in spans:
                match = LOGGER_SPAN.fullmatch(span)
                if match and (about_loggers or match["level"]) and not FILE_SUFFIX.search(span):
                    named.append((_where(page, n), match["logger"]))
                elif span.startswith("log_levels:"):
                    named += [(_where(page, n), name) for name in _levels(_yaml(span))]
    for block in code_blocks(NAMED_PAGES):
        for n, line in enumerate(block.code.splitlines(), block.line + 1):
            if match := LOG_LINE.search(line):
                named.append((_where(block.path, n), match["text"] or match["json"]))
        if block.lang == "yaml":
            lines = block.code.splitlines()
            for name in _levels(_yaml(block.code)):
                found = (n for n, line in enumerate(lines, block.line + 1) if name in line)
                named.append((_where(block.path, next(found, block.line)), name))
    assert len(named) > 3  # the pages name loggers: a pattern that finds none is broken
    broken = [f"{where}: `{name}`: not a logger of fenceproxy/log.py"
              for where, name in named if name not in LOGGERS]  # fmt: skip
    assert not broken, "\n".join(broken)


def _yaml(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return None


SCHEMA = Config.model_json_schema()
KEY = r"[a-z_][a-z0-9_]*(?:\[\d*\])?"
KEY_PATH = re.compile(rf"{KEY}(?:\.(?:{KEY}|\*))*")
KEY_FIRST = re.compile(rf"{KEY_PATH.pattern}:(?:\s|$)")
# Keys the pages write as `key:` that are not the config's, and whose they are.
NOT_CONFIG_KEYS = {
    "synchronous_mode": "Patroni's",
    "synchronous_mode_strict": "Patroni's",
    "scheme": "Prometheus' scrape config",
    "authorization": "Prometheus' scrape config",
    "errors": "a member of the lease API's 422 answer",
    "admit": "a label of model/fenceproxy.pml",
    "done": "a label of model/fenceproxy.pml",
}


def _leaves(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """What a schema node stands for, through ``$ref`` and ``anyOf`` (``null`` for an
    optional key among them)."""
    if "$ref" in node:
        yield from _leaves(SCHEMA["$defs"][node["$ref"].rsplit("/", 1)[1]])
    elif "anyOf" in node:
        for branch in node["anyOf"]:
            yield from _leaves(branch)
    else:
        yield node


def _objects(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The mappings of keys a schema node stands for, or holds a list of."""
    for leaf in _leaves(node):
        if "items" in leaf:
            yield from _objects(leaf["items"])
        elif "properties" in leaf:
            yield leaf


def _takes(objects: list[dict[str, Any]], path: list[str], value: Any = None) -> bool:
    """Whether ``path`` is a key under one of ``objects`` that takes ``value`` (None:
    no value written)."""
    head, *rest = path
    if head == "*":
        return not rest and bool(objects)
    nodes = [obj["properties"][head] for obj in objects if head in obj["properties"]]
    if rest:
        return _takes([obj for node in nodes for obj in _objects(node)], rest, value)
    return any(_fits(node, value) for node in nodes)


def _fits(node: dict[str, Any], value: Any) -> bool:
    """Whether a key of ``node`` takes ``value`` as a page writes it: one of its
    choices, a boolean where it wants one, keys it has. Other values (a size, an
    address) are the loader's to check, in the YAML blocks."""
    if value is None:
        return True
    if isinstance(value, dict) and (objects := list(_objects(node))):
        return all(isinstance(key, str) and KEY_PATH.fullmatch(key) is not None
                   and _takes(objects, _segments(key), v) for key, v in value.items())  # fmt: skip
    return any(_is(leaf, value) for leaf in _leaves(node))


def _is(leaf: dict[str, Any], value: Any) -> bool:
    if "enum" in leaf:
        return value in leaf["enum"]
    kind = leaf.get("type")
    return isinstance(value, bool) if kind == "boolean" else kind != "null"


def _segments(path: str) -> list[str]:
    """``routes[].fence.order`` to ``["routes", "fence", "order"]``."""
    return [re.sub(r"\[\d*\]$", "", part) for part in path.split(".")]


# Where a key may be: a key the pages write alone (`paths: exact`, `tls.ca`) is
# relative to the section that holds it.
ANYWHERE = [*_objects(SCHEMA), *(obj for d in SCHEMA["$defs"].values() for obj in _objects(d))]
SECTIONS = {key for obj in ANYWHERE for key, node in obj["properties"].items()
            if any(True for _ in _objects(node))}  # fmt: skip


def _config_keys(spans: list[str]) -> Iterator[tuple[str, list[str], Any]]:
    """The config keys among a line's spans, as (what is written, path, value): a
    path whose first key is a section (``limits.max_buffered``,
    ``routes[].fence.order``), or a key with its value (``order: generation``,
    ``fence: {mode: report}``). A file name (``routes.py``), a logger given a level,
    another program's key is not one."""
    for span in spans:
        if KEY_PATH.fullmatch(span) and "." in span and not FILE_SUFFIX.search(span):
            if _segments(span)[0] in SECTIONS:
                yield span, _segments(span), None
        elif KEY_FIRST.match(span) and isinstance(data := _yaml(span), dict):
            for key, value in data.items():
                path = _segments(str(key))
                if len(path) > 1 and path[0] not in SECTIONS:
                    continue  # a logger given a level, say: the logger test's
                if path[0] in NOT_CONFIG_KEYS:
                    continue
                yield span, path, value


def _keys_table(page: Path) -> Iterator[tuple[int, str, list[str]]]:
    """The first column of a table whose heading is ``key``, by line, as paths
    (``routes[].name``; ``.path`` after it is ``routes[].path``)."""
    in_table, last = False, [""]
    for n, line in enumerate(_prose_lines(page), 1):
        if not line.startswith("|"):
            in_table = False
        elif re.match(r"\|\s*key\s*\|", line):
            in_table = True
        elif in_table and not re.fullmatch(r"\|[-: |]+\|", line):
            for key in re.findall(r"`([^`]+)`", line.split("|")[1]):
                last = [*last[:-1], *_segments(key[1:])] if key[0] == "." else _segments(key)
                yield n, key, last


def test_every_config_key_the_pages_name_is_in_the_schema() -> None:
    """A key a page names (``limits.max_buffered``, ``routes[].fence.order``,
    ``paths: exact``, a table of keys) is one fenceproxy/config.py takes, with a value
    among its choices: a key renamed or a choice dropped would send an operator to a
    config the loader refuses. (The YAML blocks are loaded whole, by
    test_a_yaml_block_is_a_config_the_loader_takes.)"""
    checked, broken = 0, []
    for page in NAMED_PAGES:
        for n, _, spans in _spans(page):
            for written, path, value in _config_keys(spans):
                checked += 1
                if not _takes(ANYWHERE, path, value):
                    broken.append(f"{_where(page, n)}: `{written}`: not a config key, or not "
                                  "a value it takes (fenceproxy/config.py)")  # fmt: skip
        for n, key, path in _keys_table(page):
            checked += 1
            if not _takes(ANYWHERE, path):
                where = _where(page, n)
                broken.append(f"{where}: `{key}`: not a config key (fenceproxy/config.py)")
    assert checked > 100  # the pages name keys: a pattern that finds none is broken
    assert not broken, "\n".join(dict.fromkeys(broken))  # a table's key is a span too


METRIC = re.compile(r"(?<![\w/.-])fenceproxy_[a-z0-9_]+")
# The samples Prometheus' text format writes for each type of metric.
SAMPLES = {"counter": ("", "_total", "_created"), "gauge": ("",), "info": ("", "_info"),
           "histogram": ("", "_bucket", "_sum", "_count", "_created"),
           "summary": ("", "_sum", "_count", "_created")}  # fmt: skip
METRIC_TYPES = {"Counter": "counter", "Gauge": "gauge", "Histogram": "histogram",
                "Summary": "summary", "Info": "info"}  # fmt: skip


def _metrics() -> set[str]:
    """Every sample name of the metrics the package defines (``Counter("name", ...)``,
    ``CounterMetricFamily("name", ...)`` and the like)."""
    names = set()
    for file in (ROOT / "fenceproxy").rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            func, name = node.func, node.args[0]
            called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            kind = METRIC_TYPES.get(called.removesuffix("MetricFamily"))
            if kind and isinstance(name, ast.Constant) and isinstance(name.value, str):
                names |= {name.value + suffix for suffix in SAMPLES[kind]}
    return names


def test_every_metric_the_pages_name_is_one_the_proxy_serves() -> None:
    """A ``fenceproxy_*`` name a page writes is a metric the package defines, as
    Prometheus writes its samples (``_total``, ``_bucket`` ...), or a function the
    PostgreSQL store creates: a dashboard or an alert copied from a page finds its
    series."""
    metrics = _metrics()
    assert {"fenceproxy_decisions_total", "fenceproxy_upstream_seconds_bucket"} <= metrics
    store = ROOT / "fenceproxy" / "store"  # its code, and its schema's files
    sources = [*store.glob("*.py"), *store.glob("migrations/postgresql/*.sql")]
    code = "".join(file.read_text() for file in sources)
    functions = set(re.findall(r"\bFUNCTION\s+(fenceproxy_\w+)", code))
    broken = []
    for page in NAMED_PAGES:
        for n, line in enumerate(page.read_text().split("\n"), 1):
            for name in METRIC.findall(line):  # prose and code blocks alike
                if name not in metrics and name not in functions:
                    broken.append(f"{_where(page, n)}: `{name}`: not a metric fenceproxy "
                                  "defines (fenceproxy/ops/metrics.py), nor a function of "
                                  "its PostgreSQL store")  # fmt: skip
    assert not broken, "\n".join(broken)


# --- Diagrams: drawn from the code's tables, by the vendored Mermaid, offline ------------


def _diagrams() -> Any:
    """docs/diagrams.py, the script that draws the state diagrams from their tables."""
    spec = importlib.util.spec_from_file_location("diagrams", ROOT / "docs" / "diagrams.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_state_diagram_is_what_its_table_draws() -> None:
    """The state diagrams of the pages (the fenced write's, with what each end asks of
    the store) are drawn from the tables the code runs on: a move added, dropped or
    sent elsewhere, or an end settled otherwise, and its diagram is out of date until
    ``python3 docs/diagrams.py`` redraws it."""
    diagrams = _diagrams()
    assert diagrams.TABLES
    for name, drawing in diagrams.TABLES.items():
        text = (ROOT / "docs" / drawing.page).read_text()
        now = diagrams.redraw(text, name)
        assert now == text, f"docs/{drawing.page}: not what {name} draws: python3 docs/diagrams.py"


def _state_tables() -> set[str]:
    """The package's module-level tables named ``...TRANSITIONS``, by dotted name."""
    found = set()
    for file in (ROOT / "fenceproxy").rglob("*.py"):
        module = ".".join(file.relative_to(ROOT).with_suffix("").parts)
        for node in ast.parse(file.read_text()).body:
            targets = getattr(node, "targets", [getattr(node, "target", None)])  # =, or : T =
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            found |= {f"{module}.{name}" for name in names if name.endswith("TRANSITIONS")}
    return found


def test_every_state_table_of_the_package_is_drawn() -> None:
    """Every state table of the package (a module's ``...TRANSITIONS``) has its
    diagram on a page: a machine given a table is drawn as soon as it has one."""
    tables = _state_tables()
    assert "fenceproxy.fence.write.TRANSITIONS" in tables  # the search finds tables
    missing = sorted(tables - set(_diagrams().TABLES))
    assert not missing, (f"{', '.join(missing)}: no diagram; list it in docs/diagrams.py's "
                         "TABLES with its page, then run python3 docs/diagrams.py")  # fmt: skip


MERMAID = ROOT / "docs" / "vendor" / "mermaid" / "mermaid.tiny.js"
VENDORED = re.compile(
    r"`@mermaid-js/tiny`\s+(?P<version>[\d.]+).*?sha256\s+`(?P<sha256>[0-9a-f]{64})`", re.S
)


def test_the_vendored_mermaid_is_the_release_development_md_records() -> None:
    """The Mermaid the site loads is the release docs/development.md names, byte for
    byte (its SHA-256), at that version: a file changed or replaced without its record
    fails, so what readers run is what was reviewed."""
    record = VENDORED.search((ROOT / "docs" / "development.md").read_text())
    assert record is not None, "docs/development.md records the vendored Mermaid"
    data = MERMAID.read_bytes()
    where = MERMAID.relative_to(ROOT)
    assert hashlib.sha256(data).hexdigest() == record["sha256"], f"{where}: not the file recorded"
    assert f'"{record["version"]}"'.encode() in data, f"{where}: not {record['version']}"
    assert (MERMAID.parent / "LICENSE").read_text().startswith("The MIT License")


CHROMIUM = shutil.which("chromium")


def _fetched_beyond_the_page(netlog: Path) -> list[str]:
    """The URLs a page asked for (the requests of a file:// top frame, in Chromium's
    net log) other than files: Chromium's own requests are not the page's."""
    log = json.loads(netlog.read_text())
    start = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    requests = [event["params"] for event in log["events"] if event["type"] == start]
    return [
        request["url"]
        for request in requests
        if request.get("network_isolation_key", "").startswith("file://")
        and not request.get("url", "file:").startswith("file:")
    ]


def _open_offline(page: Path, folder: Path) -> tuple[str, list[str]]:
    """``page`` opened in headless Chromium with every request to the network refused
    (through a proxy that is not there): its DOM once its scripts are done, and what
    it asked the network for."""
    netlog = folder / f"{page.stem}.netlog.json"
    argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
            "--disable-background-networking", "--proxy-server=127.0.0.1:9",
            f"--user-data-dir={folder / 'profile'}", f"--log-net-log={netlog}",
            "--virtual-time-budget=10000", "--dump-dom", page.as_uri()]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    return done.stdout, _fetched_beyond_the_page(netlog)


@pytest.mark.slow
def test_every_diagram_of_the_site_draws_offline(tmp_path: Path) -> None:
    """A reader of the built site sees every diagram drawn with no network: each
    ``mermaid`` block of docs/ is drawn by the vendored Mermaid in a real browser
    (Debian's chromium), and a page with one asks the network for nothing."""
    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed (make servers)")
    site = tmp_path / "site"
    build = [sys.executable, "-m", "mkdocs", "build", "--quiet", "-f", str(ROOT / "mkdocs.yml"),
             "-d", str(site)]  # fmt: skip
    subprocess.run(build, check=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    diagrams = collections.Counter(
        b.path.stem for b in BLOCKS if b.lang == "mermaid" and b.path.parent.name == "docs"
    )
    # The worked example, where the proxy sits, the fenced write's states.
    assert {"protocol", "index", "fenced-write-states"} <= set(diagrams)
    for page, count in diagrams.items():
        dom, fetched = _open_offline(site / f"{page}.html", tmp_path)
        assert dom.count('<div class="mermaid">') == count, f"docs/{page}.md: not drawn"
        assert '<pre class="mermaid"' not in dom, f"docs/{page}.md: a diagram left undrawn"
        assert fetched == [], f"docs/{page}.md: asked the network for {fetched}"
