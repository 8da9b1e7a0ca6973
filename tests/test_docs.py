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
* ``text``: shown, not checked (logs and output).

A block marked ``<!-- skip: why -->`` is not checked. Also: README.md stays a front
page (250 lines at most), every relative link points to a file that exists (and an
anchor to a heading there), and mkdocs.yml's nav lists every page.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import shlex
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from fenceproxy import cli
from fenceproxy.config import load_config

from .certs import Certificates

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = {"yaml", "python", "sh", "console", "json", "http", "text"}
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
    """Every secret a config names: signing keys and lease API clients."""
    if not isinstance(data, dict):
        return
    for section, key in (("signing", "keys"), ("leases", "clients")):
        if isinstance(data.get(section), dict):
            yield from data[section].get(key) or []
    yield from data.get("admin_clients") or []


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


def _prose(page: Path) -> str:
    """A page without its code blocks."""
    return re.sub(r"^ *(```+)[\w-]*\n.*?^ *\1 *$", "", page.read_text(), flags=re.M | re.S)


def test_every_relative_link_points_to_a_file_and_heading_that_exist() -> None:
    broken = []
    for page in PAGES:
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
