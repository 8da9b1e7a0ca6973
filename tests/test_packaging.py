"""What a user installs: the clients work where none of the proxy's libraries are
installed, and the release artefacts (a wheel and an sdist) build, pass
``twine check``, install into fresh venvs from the locks and run there."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml

from fenceproxy import __version__
from fenceproxy.testing import ProxyProcess, RecordingUpstream, free_port

ROOT = Path(__file__).resolve().parent.parent
SERVER_ONLY = ("aiohttp", "pydantic", "yaml", "asyncpg", "prometheus_client", "multidict", "yarl")

# Run before anything else in a child interpreter: the server's libraries cannot be
# imported, as in a venv where `pip install fenceproxy` put only the clients.
WITHOUT_SERVER = f"""
import sys
class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {SERVER_ONLY!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, _NotInstalled())
"""


def run(*argv: str | os.PathLike[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=300, check=False,
        **kwargs,  # type: ignore[arg-type]
    )  # fmt: skip


def proxy_config(tmp_path: Path, upstream: RecordingUpstream) -> Path:
    path = tmp_path / "proxy.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "store": f"sqlite:///{tmp_path / 'fences.db'}",
                "leases": {},
                "routes": [{"name": "billing", "path": "/billing/", "upstream": upstream.url}],
            }
        )
    )
    return path


async def test_a_worker_holds_a_lease_without_the_servers_libraries(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    proxy = await ProxyProcess(proxy_config(tmp_path, upstream), free_port()).start()
    try:
        worker = WITHOUT_SERVER + (
            "import fenceproxy\n"
            "from fenceproxy.client import SyncLeaseClient\n"
            "with SyncLeaseClient(sys.argv[1]) as leases,"
            " leases.hold('job', owner='w', ttl=30) as lease:\n"
            "    print(lease.generation, lease.headers()['Fencing-Token'])\n"
            "    lease.complete()\n"
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(SERVER_ONLY)!r}))\n"
        )
        done = run(sys.executable, "-c", worker, proxy.url)
        assert (done.returncode, done.stdout.split("\n")[:2]) == (0, ["1 1", "[]"]), done.stderr
        # The command line's lease calls work there too; serving says what it lacks.
        cli = WITHOUT_SERVER + "from fenceproxy.cli import main; sys.exit(main(sys.argv[1:]))"
        shown = run(sys.executable, "-c", cli, "lease", "show", "job", "--url", proxy.url)
        assert shown.returncode == 0, shown.stderr
        assert '"state": "completed"' in shown.stdout
        serve = run(sys.executable, "-c", cli, "serve", "-c", tmp_path / "proxy.yaml")
        assert serve.returncode == 2
        assert serve.stderr == (
            "fenceproxy: serve needs the proxy's libraries (aiohttp is not installed): "
            "pip install 'fenceproxy[server]'\n"
        )
    finally:
        await proxy.stop()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_wheel_and_sdist_build_and_run_in_fresh_venvs(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    # No isolation: the build backend is the lock's hash-pinned setuptools.
    built = run(sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, ROOT)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    assert wheel.name == f"fenceproxy-{__version__}-py3-none-any.whl"
    checked = run(sys.executable, "-m", "twine", "check", "--strict", wheel, sdist)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    shipped = set(zipfile.ZipFile(wheel).namelist())
    assert {"fenceproxy/ops/static/page.js", "fenceproxy/ops/static/page.css",
            "fenceproxy/server/lease-api.json", "fenceproxy/client/core.py"} <= shipped  # fmt: skip
    assert not any(name.startswith("tests/") for name in shipped)
    schemas = {str(p.relative_to(ROOT)) for p in ROOT.glob("fenceproxy/store/migrations/*/*.sql")}
    assert len(schemas) >= 11  # each store's schema, one file per version
    assert schemas <= shipped
    with tarfile.open(sdist) as tar:
        assert f"fenceproxy-{__version__}/fenceproxy/ops/static/page.js" in tar.getnames()
        assert {f"fenceproxy-{__version__}/{name}" for name in schemas} <= set(tar.getnames())

    # A worker's venv: the client's lock, then the wheel alone.
    client = tmp_path / "client-venv"
    install(client, "client.lock", wheel)
    version = run(client / "bin" / "fenceproxy", "--version")
    assert version.stdout == f"fenceproxy {__version__}\n", version.stderr
    imported = run(
        client / "bin" / "python", "-c",
        f"import fenceproxy.client, sys; print([m for m in {SERVER_ONLY!r} if m in sys.modules])",
    )  # fmt: skip
    assert imported.stdout == "[]\n", imported.stderr
    lacking = run(client / "bin" / "python", "-c", "import aiohttp")
    assert lacking.returncode != 0  # truly not there
    serve = run(client / "bin" / "fenceproxy", "serve", "-c", ROOT / "config" / "minimal.yaml")
    assert serve.returncode == 2
    assert "pip install 'fenceproxy[server]'" in serve.stderr

    # A proxy's venv: the server's lock, then the wheel alone.
    server = tmp_path / "server-venv"
    install(server, "server.lock", wheel)
    config = tmp_path / "proxy.yaml"
    config.write_text(
        "store: sqlite:///fences.db\n"
        "routes: [{name: billing, path: /billing/, upstream: 'http://127.0.0.1:9000'}]\n"
    )
    checked_config = run(server / "bin" / "fenceproxy", "check-config", "-c", config)
    assert (checked_config.returncode, checked_config.stdout) == (
        0,
        f"{config}: OK, 1 route(s)\n",
    ), checked_config.stderr


def install(venv: Path, lock: str, wheel: Path) -> None:
    """A venv holding ``lock`` and then ``wheel``, filled by this Python's pip (a pip
    of its own in each would take longer to install than the rest)."""
    made = run(sys.executable, "-m", "venv", "--without-pip", venv)
    assert made.returncode == 0, made.stderr
    pip = (sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install")
    quiet = ("--quiet", "--no-compile", "--disable-pip-version-check")
    deps = run(*pip, *quiet, "--require-hashes", "-r", ROOT / "requirements" / lock)
    assert deps.returncode == 0, deps.stderr[-2000:]
    package = run(*pip, *quiet, "--no-deps", wheel)
    assert package.returncode == 0, package.stderr[-2000:]


def test_the_proxy_loads_none_of_the_clients_http_library() -> None:
    loaded = run(
        sys.executable, "-c",
        "import sys, fenceproxy, fenceproxy.cli, fenceproxy.server.app;"
        " print('httpx' in sys.modules)",
    )  # fmt: skip
    assert loaded.stdout == "False\n", loaded.stderr
