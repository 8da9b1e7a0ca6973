"""The lock files install what pyproject.toml asks for: every requirement pinned at a
version its bounds allow, every pin with its hashes, the server's and the client's
locks at the same versions as the one CI installs, the client's without the server's
libraries. A dependency changed in pyproject.toml without ``make lock`` fails here."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
_PIN = re.compile(r"^([A-Za-z0-9._-]+)==(\S+)((?:\s*\\\n\s+--hash=sha256:[0-9a-f]{64})+)", re.M)


def pins(lock: str) -> dict[str, tuple[Version, int]]:
    """Each package a lock pins: its version and how many hashes it lists."""
    text = (ROOT / "requirements" / lock).read_text()
    found = {
        canonicalize_name(name): (Version(version), hashes.count("--hash="))
        for name, version, hashes in _PIN.findall(text)
    }
    # Nothing in it is pinned without hashes (pip would refuse the file anyway).
    assert len(found) == len(re.findall(r"^[A-Za-z0-9._-]+==", text, re.M))
    return found


def requirements(*extras: str) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = list(project["dependencies"])
    for extra in extras:
        listed += project["optional-dependencies"][extra]
    return [Requirement(r) for r in listed]


@pytest.mark.parametrize(
    ("lock", "extras"),
    [
        ("dev.lock", ("server", "test", "dev", "fast", "otel")),
        ("server.lock", ("server", "fast", "otel")),
        ("client.lock", ()),
        ("demo.lock", ("server",)),
    ],
)
def test_every_requirement_is_pinned_within_its_bounds_with_hashes(
    lock: str, extras: tuple[str, ...]
) -> None:
    locked = pins(lock)
    for requirement in requirements(*extras):
        name = canonicalize_name(requirement.name)
        assert name in locked, f"{requirement} is not in requirements/{lock}: run make lock"
        version, hashes = locked[name]
        assert requirement.specifier.contains(version, prereleases=True), (
            f"requirements/{lock} pins {name}=={version}, outside {requirement}: run make lock"
        )
        assert hashes >= 1


@pytest.mark.parametrize("lock", ["server.lock", "client.lock", "demo.lock"])
def test_the_deployed_locks_are_the_tested_versions(lock: str) -> None:
    tested = pins("dev.lock")
    for name, (version, _) in pins(lock).items():
        assert tested[name][0] == version, name


def test_the_client_lock_holds_none_of_the_servers_libraries() -> None:
    client = pins("client.lock")
    for requirement in requirements("server", "fast", "otel"):
        if requirement not in requirements():
            assert canonicalize_name(requirement.name) not in client, requirement


def test_aiohttp_is_at_least_the_release_that_fixed_the_response_parser() -> None:
    (aiohttp,) = [r for r in requirements("server") if r.name == "aiohttp"]
    assert not aiohttp.specifier.contains("3.14.2")
    assert pins("server.lock")["aiohttp"][0] >= Version("3.14.3")


def test_the_installer_make_test_uses_is_pinned_with_hashes() -> None:
    """uv fills the test venv: it is installed from a lock of its own, like the rest."""
    locked = pins("installer.lock")
    assert set(locked) == {"uv"}
    assert locked["uv"][1] >= 1
