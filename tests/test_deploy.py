"""The deployment recipes in deploy/, checked as far as a machine without Docker or a
cluster can: every YAML parses and every fenceproxy config shipped there validates;
the files agree with one another (ports, probes, mounts, secrets, timeouts); the
commands the image, the compose file and the systemd unit run are run here, from the
venv, against real proxies; the unit passes ``systemd-analyze``. The image itself is
not built here."""

from __future__ import annotations

import asyncio
import fnmatch
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import asyncpg
import pytest
import yaml

from fenceproxy.config import Config, load_config, parse_config, parse_listen
from fenceproxy.fence.tokens import generate_key
from fenceproxy.store import migrate_store
from fenceproxy.store.postgres import SCHEMA_VERSION
from fenceproxy.store.url import parse_store_url
from fenceproxy.testing import ProxyProcess, RecordingUpstream, free_port, status

from .certs import Certificates
from .postgres import PostgresServer, postgres_bin, sql

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "docker-compose.yml"
KUBERNETES = DEPLOY / "kubernetes" / "sidecar.yaml"
UNIT = DEPLOY / "fenceproxy.service"
HA = DEPLOY / "ha"
UNIT_CONFIG = DEPLOY / "fenceproxy.yaml"
# Where the venv's console scripts are: the `fenceproxy` the recipes run.
VENV_BIN = Path(sys.executable).parent


# --- reading the recipes ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Instruction:
    keyword: str
    args: str
    line: int


def dockerfile_instructions(text: str) -> list[Instruction]:
    """A Dockerfile's instructions, continuation lines joined, comments dropped."""
    found: list[Instruction] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):  # comments, parser directives, blank lines
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        found.append(Instruction(keyword.upper(), args.strip(), start))
        pending = ""
    assert not pending, "a continuation runs past the end of the Dockerfile"
    return found


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    froms = [n for n, i in enumerate(instructions) if i.keyword == "FROM"]
    assert froms, "no FROM"
    return instructions[froms[-1] :]


def one(instructions: list[Instruction], keyword: str) -> Instruction:
    (found,) = [i for i in instructions if i.keyword == keyword]
    return found


def exec_form(args: str) -> list[str]:
    """A JSON-array (exec form) argument list. The shell form would run the command
    under /bin/sh, which would take the signals meant for fenceproxy."""
    assert args.startswith("["), f"not in exec form: {args}"
    argv = json.loads(args)
    assert isinstance(argv, list)
    assert all(isinstance(a, str) for a in argv)
    return argv


def healthcheck(instructions: list[Instruction]) -> tuple[dict[str, str], list[str]]:
    """A HEALTHCHECK's options (``{"--timeout": "3s"}``) and its command."""
    m = re.fullmatch(r"((?:--[a-z-]+=\S+\s+)*)CMD\s+(.+)", one(instructions, "HEALTHCHECK").args)
    assert m is not None, "HEALTHCHECK without CMD"
    options = dict(option.split("=", 1) for option in m.group(1).split())
    return options, exec_form(m.group(2))


def seconds(value: str) -> float:
    """``45``, ``45s``, ``2min``, ``1m30s`` (systemd, Docker and fenceproxy durations)."""
    units = {"": 1.0, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
    parts = re.findall(r"([0-9.]+)\s*([a-z]*)", value.strip())
    assert "".join(n + u for n, u in parts) == value.replace(" ", ""), value
    assert parts, value
    return sum(float(n) * units[u] for n, u in parts)


def kubernetes_quantity(value: str) -> int:
    m = re.fullmatch(r"([0-9]+)(Ki|Mi|Gi)?", value)
    assert m is not None, value
    return int(m.group(1)) * {None: 1, "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3}[m.group(2)]


def unit_file(text: str) -> dict[str, list[tuple[str, str]]]:
    """A systemd unit's settings per section, in order, repeated keys kept."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not a setting: {raw}"
        assert current is not None, f"before any section: {raw}"
        current.append((key.strip(), value.strip()))
    return sections


def unit_setting(text: str, key: str, section: str = "Service") -> str:
    """A setting's value; the last one when it is given more than once, as systemd reads it."""
    values = [v for k, v in unit_file(text)[section] if k == key]
    assert values, f"[{section}] has no {key}="
    return values[-1]


def yaml_documents(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def configmap_config() -> str:
    (configmap,) = [d for d in yaml_documents(KUBERNETES) if d["kind"] == "ConfigMap"]
    text = configmap["data"]["fenceproxy.yaml"]
    assert isinstance(text, str)
    return text


def shipped_configs() -> dict[str, str]:
    """Every fenceproxy config deploy/ ships or embeds, by where it is."""
    return {
        "compose/fenceproxy.yaml": (DEPLOY / "compose" / "fenceproxy.yaml").read_text(),
        "fenceproxy.yaml": UNIT_CONFIG.read_text(),
        "kubernetes/sidecar.yaml ConfigMap": configmap_config(),
        "ha/fenceproxy.yaml": (HA / "fenceproxy.yaml").read_text(),
    }


def model(text: str) -> Config:
    """The config validated, without reading the secrets it names or its store."""
    return parse_config(yaml.safe_load(text), "deploy")


def secrets_named(config: Config) -> set[str]:
    """The environment variables a config reads its secrets from."""
    names = set()
    if (password := parse_store_url(config.store).password_env) is not None:
        names.add(password)
    clients = config.leases.clients if config.leases else ()
    keys = config.signing.keys if config.signing else ()
    for spec in (*clients, *keys):
        assert spec.env is not None, "a secret file would need a mount in every recipe"
        names.add(spec.env)
    return names


def secret_values(config: Config) -> dict[str, str]:
    """A well-formed value for each secret the config names."""
    return {name: generate_key() for name in secrets_named(config)}


CREDENTIALS = "/run/credentials/fenceproxy.service/"
"""Where systemd hands the unit its credentials (LoadCredential=)."""


def with_certificates(text: str, directory: Path) -> str:
    """The config with the TLS files it names made in ``directory``/tls (the unit's
    credentials there rather than where systemd puts them)."""
    Certificates(directory / "ca").server("fenceproxy")
    (directory / "tls").mkdir()
    for name in ("fenceproxy.pem", "fenceproxy-key.pem"):
        (directory / "ca" / name).rename(directory / "tls" / name)
    return text.replace(CREDENTIALS, f"{directory}/tls/")


def with_sqlite_store(text: str, directory: Path) -> str:
    """The config with its store moved to a SQLite file in ``directory``."""
    store = model(text).store
    assert text.count(store) == 1
    return text.replace(store, f"sqlite:///{directory / 'fences.db'}")


# --- every YAML parses; every config validates ------------------------------------


def test_every_yaml_in_deploy_parses() -> None:
    files = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
    assert len(files) >= 4
    for path in files:
        assert yaml_documents(path), f"{path} holds no document"


@pytest.mark.parametrize("where", sorted(shipped_configs()))
def test_every_shipped_config_validates_with_its_secrets_set(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = shipped_configs()[where]
    path = tmp_path / "fenceproxy.yaml"
    path.write_text(with_certificates(text, tmp_path))
    for name, value in secret_values(model(text)).items():
        monkeypatch.setenv(name, value)
    config = load_config(path)  # reads every secret, never the store
    assert config.routes
    # Nothing in deploy/ is a proxy on loopback alone.
    assert parse_listen(config.listen)[0] == "0.0.0.0"


def test_check_config_passes_on_the_unit_config(tmp_path: Path) -> None:
    """check-config also checks the store: here a SQLite folder of the test's own."""
    text = UNIT_CONFIG.read_text()
    path = tmp_path / "fenceproxy.yaml"
    path.write_text(with_certificates(with_sqlite_store(text, tmp_path), tmp_path))
    result = subprocess.run(
        [str(VENV_BIN / "fenceproxy"), "check-config", "-c", str(path)],
        capture_output=True,
        text=True,
        env={"PATH": str(VENV_BIN), **secret_values(model(text))},
        check=False,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert "OK, 1 route(s)" in result.stdout


# --- the Dockerfile ---------------------------------------------------------------


def test_the_image_is_a_slim_python_at_the_locks_version() -> None:
    instructions = dockerfile_instructions(DOCKERFILE.read_text())
    lock = (ROOT / "requirements" / "server.lock").read_text()
    m = re.search(r"autogenerated by pip-compile with Python (3\.[0-9]+)", lock)
    assert m is not None
    for stage in [i for i in instructions if i.keyword == "FROM"]:
        image = stage.args.split()[0]
        found = re.fullmatch(
            r"python:(3\.[0-9]+)(?:\.[0-9]+)?-slim(?:-[a-z]+)?(?:@sha256:[0-9a-f]{64})?", image
        )
        assert found is not None, f"line {stage.line}: {image} is not a slim Python image"
        # The lock's hashes are for the wheels of the Python it was compiled on.
        assert found.group(1) == m.group(1)


def test_the_image_installs_from_the_lock_with_hashes_then_the_package_alone() -> None:
    runs = [i.args for i in dockerfile_instructions(DOCKERFILE.read_text()) if i.keyword == "RUN"]
    locked = [r for r in runs if "--require-hashes -r /src/requirements/server.lock" in r]
    assert len(locked) == 1
    package = [r for r in runs if re.search(r"pip install --no-deps --no-build-isolation /src$", r)]
    assert len(package) == 1
    assert runs.index(locked[0]) < runs.index(package[0])


def test_what_the_image_copies_is_in_the_repository_and_not_ignored() -> None:
    ignored = [
        line.strip()
        for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert {".git", ".venv"} <= set(ignored)
    copies = [i for i in dockerfile_instructions(DOCKERFILE.read_text()) if i.keyword == "COPY"]
    sources = [s for c in copies if not c.args.startswith("--from") for s in c.args.split()[:-1]]
    assert "requirements/server.lock" in sources
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
        assert not any(fnmatch.fnmatch(source, p.removeprefix("**/")) for p in ignored), source


def test_the_image_runs_as_a_numeric_non_root_user_before_its_command() -> None:
    stage = final_stage(dockerfile_instructions(DOCKERFILE.read_text()))
    keywords = [i.keyword for i in stage]
    assert "USER" in keywords
    assert keywords.index("USER") < keywords.index("CMD")
    user, _, group = one(stage, "USER").args.partition(":")
    # Kubernetes' runAsNonRoot can check a number only.
    assert user.isdigit()
    assert int(user) != 0
    assert group == "" or (group.isdigit() and int(group) != 0)


def test_the_image_exposes_the_ports_its_configs_listen_on() -> None:
    stage = final_stage(dockerfile_instructions(DOCKERFILE.read_text()))
    exposed = {int(p.split("/")[0]) for p in one(stage, "EXPOSE").args.split()}
    for where in ("compose/fenceproxy.yaml", "kubernetes/sidecar.yaml ConfigMap"):
        config = model(shipped_configs()[where])
        assert config.admin is not None
        assert exposed == {parse_listen(config.listen)[1], parse_listen(config.admin)[1]}, where


def test_the_image_probes_healthz_and_serves_the_mounted_config() -> None:
    stage = final_stage(dockerfile_instructions(DOCKERFILE.read_text()))
    options, probe = healthcheck(stage)
    assert probe[:2] == ["python", "-c"]
    assert "http://127.0.0.1:9901/healthz" in probe[2]
    assert seconds(options["--timeout"]) > 0
    assert exec_form(one(stage, "CMD").args) == [
        "fenceproxy",
        "serve",
        "-c",
        "/etc/fenceproxy/fenceproxy.yaml",
    ]
    assert one(stage, "STOPSIGNAL").args == "SIGTERM"


async def run_probe(probe: list[str], admin_url: str, within: float) -> int:
    """The image's HEALTHCHECK command, its python the venv's, pointed at ``admin_url``."""
    argv = [sys.executable, *probe[1:2], probe[2].replace("http://127.0.0.1:9901", admin_url)]
    assert argv[2] != probe[2]
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    async with asyncio.timeout(within):  # Docker counts a probe past --timeout as failed
        return await process.wait()


@pytest.mark.slow
async def test_the_image_healthcheck_passes_on_its_command_and_fails_otherwise(
    tmp_path: Path,
) -> None:
    stage = final_stage(dockerfile_instructions(DOCKERFILE.read_text()))
    options, probe = healthcheck(stage)
    within = seconds(options["--timeout"])
    command = exec_form(one(stage, "CMD").args)
    assert command[1:3] == ["serve", "-c"]
    # The image's command, from the venv, on the compose config; on loopback ports
    # and a SQLite file, since nothing here resolves the compose services' names.
    text = (DEPLOY / "compose" / "fenceproxy.yaml").read_text()
    config = tmp_path / "fenceproxy.yaml"
    config.write_text(text)
    proxy = ProxyProcess(
        config,
        free_port(),
        "--store",
        f"sqlite:///{tmp_path / 'fences.db'}",
        command=[str(VENV_BIN / command[0])],
        env=secret_values(model(text)),
    )
    try:
        await proxy.start()
        assert await run_probe(probe, proxy.admin_url, within) == 0
        async with RecordingUpstream.serve() as failing:
            failing.respond = status(503)
            assert await run_probe(probe, failing.url, within) != 0
    finally:
        await proxy.stop()
    assert await run_probe(probe, proxy.admin_url, within) != 0  # nothing listens


# --- the compose file -------------------------------------------------------------


def compose_services() -> dict[str, dict[str, Any]]:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert isinstance(services, dict)
    return services


def built_from_the_dockerfile(service: dict[str, Any]) -> bool:
    build = service.get("build")
    if not isinstance(build, dict):
        return False
    context = (COMPOSE.parent / build["context"]).resolve()
    return bool((context / build["dockerfile"]).resolve() == DOCKERFILE)


def compose_fenceproxies() -> Iterator[tuple[str, dict[str, Any], list[str]]]:
    """Each service running the image: its name, its settings and its command."""
    image_command = exec_form(
        one(final_stage(dockerfile_instructions(DOCKERFILE.read_text())), "CMD").args
    )
    for name, service in compose_services().items():
        if built_from_the_dockerfile(service):
            yield name, service, service.get("command", image_command)


def mounted_config(service: dict[str, Any], command: list[str]) -> Path:
    """The file in deploy/ mounted where ``command``'s ``-c`` reads."""
    inside = command[command.index("-c") + 1]
    for volume in service.get("volumes", []):
        source, target, *_ = volume.split(":")
        if target == inside:
            return (COMPOSE.parent / str(source)).resolve()
    raise AssertionError(f"nothing is mounted at {inside}")


def test_compose_dependencies_exist_and_their_conditions_can_be_met() -> None:
    services = compose_services()
    image_checks_health = "HEALTHCHECK" in {
        i.keyword for i in final_stage(dockerfile_instructions(DOCKERFILE.read_text()))
    }
    for name, service in services.items():
        for needed, spec in service.get("depends_on", {}).items():
            assert needed in services, f"{name} depends on {needed}, which is not a service"
            target = services[needed]
            if spec["condition"] == "service_healthy":
                own = target.get("healthcheck", {})
                assert not own.get("disable", False)
                assert "test" in own or (built_from_the_dockerfile(target) and image_checks_health)
            elif spec["condition"] == "service_completed_successfully":
                assert target.get("restart", "no") == "no", f"{needed} must run once"
            else:
                assert spec["condition"] == "service_started"


def test_compose_proxies_serve_after_the_schema_is_migrated() -> None:
    fenceproxies = list(compose_fenceproxies())
    (migrate,) = [name for name, _, command in fenceproxies if command[1] == "migrate"]
    servers = [(name, service) for name, service, command in fenceproxies if command[1] == "serve"]
    assert len(servers) == 2  # two proxies on one store
    for name, service in servers:
        depends = service["depends_on"]
        assert depends[migrate]["condition"] == "service_completed_successfully", name
        assert depends["postgres"]["condition"] == "service_healthy", name
        assert "postgres" in compose_services()[migrate]["depends_on"]


def test_compose_fenceproxies_get_their_config_and_every_secret_it_names() -> None:
    services = compose_services()
    for name, service, command in compose_fenceproxies():
        path = mounted_config(service, command)
        assert path == DEPLOY / "compose" / "fenceproxy.yaml", name
        config = model(path.read_text())
        environment = service["environment"]
        for secret in secrets_named(config):
            # From the environment of whoever runs compose, never a value in the file.
            assert environment[secret].startswith("${" + secret + ":?"), (name, secret)
        # The database's password is the one the proxies send.
        password_env = parse_store_url(config.store).password_env
        postgres = services["postgres"]["environment"]
        assert postgres["POSTGRES_PASSWORD"] == environment[password_env]
        store = urlsplit(parse_store_url(config.store).dsn)
        assert store.username == postgres["POSTGRES_USER"]
        assert store.path == "/" + postgres["POSTGRES_DB"]


def test_compose_proxies_reach_their_store_and_upstream_and_publish_no_admin_port() -> None:
    services = compose_services()
    for name, service, command in compose_fenceproxies():
        config = model(mounted_config(service, command).read_text())
        store_host = urlsplit(parse_store_url(config.store).dsn).hostname
        needed = {store_host} | {urlsplit(r.upstream).hostname for r in config.routes}
        for host in needed:
            assert host in services, f"{name}: no service {host}"
            assert set(services[host]["networks"]) & set(service["networks"]), (name, host)
        if command[1] != "serve":
            continue
        # Longer than shutdown_timeout, or requests in flight are killed.
        assert seconds(service["stop_grace_period"]) > config.shutdown_timeout
        assert config.admin is not None
        admin_port = parse_listen(config.admin)[1]
        published = {}
        for port in service["ports"]:
            *host_ip, _, inside = port.split(":")
            published[int(inside)] = host_ip
        assert parse_listen(config.listen)[1] in published
        assert published[admin_port] == ["127.0.0.1"], "the admin port takes no credentials"
    # The database and the API publish nothing: every writer goes through a proxy.
    assert "ports" not in services["postgres"]
    assert "ports" not in services["upstream"]


@pytest.mark.slow
async def test_compose_commands_migrate_then_serve_on_postgresql(
    postgres: PostgresServer, tmp_path: Path
) -> None:
    """What compose runs, in its order, against a real database: the proxies refuse
    to start before migrate, and serve after it."""
    fenceproxies = {name: (service, command) for name, service, command in compose_fenceproxies()}
    _, migrate = fenceproxies["migrate"]
    _, serve = fenceproxies["proxy-a"]
    text = (DEPLOY / "compose" / "fenceproxy.yaml").read_text()
    config = tmp_path / "fenceproxy.yaml"
    config.write_text(text)
    secrets = secret_values(model(text))
    # The config's own store URL, options and all, on this machine's database.
    await sql(
        postgres.url(), "DROP DATABASE IF EXISTS deploy_recipe", "CREATE DATABASE deploy_recipe"
    )
    here = urlsplit(postgres.url("deploy_recipe"))
    store = urlunsplit(urlsplit(model(text).store)._replace(netloc=here.netloc, path=here.path))
    assert "password_env=" in store

    def proxy() -> ProxyProcess:
        return ProxyProcess(
            config, free_port(), "--store", store, command=[str(VENV_BIN / serve[0])], env=secrets
        )

    early = proxy()
    try:
        with pytest.raises(RuntimeError, match="exited 2"):
            await early.start()
        assert "not migrated" in early.output()
    finally:
        await early.stop()

    argv = [str(VENV_BIN / migrate[0]), *migrate[1:3], str(config), "--store", store]
    assert migrate[2] == "-c"
    process = await asyncio.create_subprocess_exec(
        *argv, env={"PATH": str(VENV_BIN), **secrets}, stdout=subprocess.PIPE
    )
    out, _ = await process.communicate()
    assert process.returncode == 0, out

    serving = proxy()
    try:
        await serving.start()
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{serving.admin_url}/readyz") as ready:
                assert ready.status == 200
            claim = f"{serving.url}/_leases/invoice-1/claim"
            async with session.post(claim, json={}) as anonymous:
                assert anonymous.status == 401
            token = secrets["FENCEPROXY_LEASES_WORKERS"]
            async with session.post(
                claim, json={}, headers={"Authorization": f"Bearer {token}"}
            ) as granted:
                assert granted.status == 200
                assert (await granted.json())["owner"] == "workers"
    finally:
        await serving.stop()


# --- the Kubernetes manifest ------------------------------------------------------


def kubernetes(kind: str) -> dict[str, Any]:
    (found,) = [d for d in yaml_documents(KUBERNETES) if d["kind"] == kind]
    assert isinstance(found, dict)
    return found


def pod() -> dict[str, Any]:
    spec = kubernetes("Deployment")["spec"]["template"]["spec"]
    assert isinstance(spec, dict)
    return spec


def container(name: str) -> dict[str, Any]:
    spec = pod()
    (found,) = [c for c in spec["containers"] + spec.get("initContainers", []) if c["name"] == name]
    assert isinstance(found, dict)
    return found


def container_port(spec: dict[str, Any], port: int | str) -> int:
    """A probe's or a Service's port, by number or by the container port's name."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in spec.get("ports", []) if p["name"] == port]
    assert isinstance(number, int)
    return number


def kubernetes_config() -> Config:
    return model(configmap_config())


def test_kubernetes_probes_ask_the_admin_listener_where_it_listens() -> None:
    proxy = container("fenceproxy")
    config = kubernetes_config()
    assert config.admin is not None
    host, port = parse_listen(config.admin)
    # The kubelet probes the pod's IP: an admin listener on loopback would fail them.
    assert host in ("0.0.0.0", "::")
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = proxy[probe]["httpGet"]
        assert get["path"] == path
        assert container_port(proxy, get["port"]) == port, probe
    annotations = kubernetes("Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == port


def test_kubernetes_service_exposes_the_proxy_port_alone() -> None:
    proxy = container("fenceproxy")
    config = kubernetes_config()
    assert config.admin is not None
    admin_port = parse_listen(config.admin)[1]
    targets = {
        container_port(proxy, p["targetPort"]) for p in kubernetes("Service")["spec"]["ports"]
    }
    assert targets == {parse_listen(config.listen)[1]}
    # Only the monitoring namespace may reach the admin port.
    rules = kubernetes("NetworkPolicy")["spec"]["ingress"]
    admin = [
        r for r in rules if any(container_port(proxy, p["port"]) == admin_port for p in r["ports"])
    ]
    assert admin
    assert all(rule.get("from") for rule in admin)


def test_kubernetes_containers_run_restricted() -> None:
    spec = pod()
    pod_context = spec.get("securityContext", {})
    for each in spec["containers"] + spec.get("initContainers", []):
        context = {**pod_context, **each.get("securityContext", {})}
        assert context.get("runAsNonRoot") is True, each["name"]
        assert context.get("runAsUser", 0) != 0, each["name"]
        assert context.get("readOnlyRootFilesystem") is True, each["name"]
        assert context.get("allowPrivilegeEscalation") is False, each["name"]
        assert context.get("capabilities", {}).get("drop") == ["ALL"], each["name"]
    user = one(final_stage(dockerfile_instructions(DOCKERFILE.read_text())), "USER").args
    assert container("fenceproxy")["securityContext"]["runAsUser"] == int(user.split(":")[0])


def test_kubernetes_fenceproxies_get_their_config_and_secrets_from_a_secret() -> None:
    image_command = exec_form(
        one(final_stage(dockerfile_instructions(DOCKERFILE.read_text())), "CMD").args
    )
    configmap = kubernetes("ConfigMap")
    volumes = {v["name"]: v for v in pod()["volumes"]}
    config = kubernetes_config()
    for name, verb in (("migrate", "migrate"), ("fenceproxy", "serve")):
        spec = container(name)
        command = spec.get("command", image_command)
        assert command[:3] == ["fenceproxy", verb, "-c"], name
        path = Path(command[3])
        (mount,) = [m for m in spec["volumeMounts"] if Path(m["mountPath"]) == path.parent]
        assert volumes[mount["name"]]["configMap"]["name"] == configmap["metadata"]["name"]
        assert path.name in configmap["data"]
        env = {e["name"]: e for e in spec["env"]}
        for secret in secrets_named(config):
            assert "value" not in env[secret], f"{name}: {secret} is written in the manifest"
            assert env[secret]["valueFrom"]["secretKeyRef"]["name"], (name, secret)


def test_kubernetes_pod_fits_the_config_limits_and_shutdown() -> None:
    config = kubernetes_config()
    assert pod()["terminationGracePeriodSeconds"] > config.shutdown_timeout
    memory = kubernetes_quantity(container("fenceproxy")["resources"]["limits"]["memory"])
    assert config.limits.max_buffered < memory


def test_kubernetes_api_is_on_the_pods_loopback_where_the_route_sends() -> None:
    (route,) = kubernetes_config().routes
    upstream = urlsplit(route.upstream)
    assert upstream.hostname == "127.0.0.1"  # nothing outside the pod reaches it
    assert f"-listen=127.0.0.1:{upstream.port}" in container("app")["args"]


# --- the systemd unit -------------------------------------------------------------


def test_the_unit_reloads_on_hup_and_outwaits_the_shutdown_timeout() -> None:
    text = UNIT.read_text()
    config = model(UNIT_CONFIG.read_text())
    assert re.fullmatch(r"/bin/kill -(s )?HUP \$MAINPID", unit_setting(text, "ExecReload"))
    assert unit_setting(text, "KillSignal") == "SIGTERM"
    assert seconds(unit_setting(text, "TimeoutStopSec")) > config.shutdown_timeout
    # The connection cap is fitted below (limit - 64) / 2: this limit keeps it whole.
    assert int(unit_setting(text, "LimitNOFILE")) >= 2 * config.limits.max_connections + 64


def test_the_unit_serves_the_example_config_from_its_state_directory() -> None:
    text = UNIT.read_text()
    assert shlex.split(unit_setting(text, "ExecStart"))[1:] == [
        "serve",
        "-c",
        "/etc/fenceproxy/fenceproxy.yaml",
    ]
    store = parse_store_url(model(UNIT_CONFIG.read_text()).store)
    assert store.backend == "sqlite"
    state = Path("/var/lib") / unit_setting(text, "StateDirectory")
    assert Path(store.path).parent == state
    # The TLS pair: root's files, handed over as credentials where the config looks.
    tls = model(UNIT_CONFIG.read_text()).tls
    assert tls is not None
    handed = {
        CREDENTIALS + name: source
        for k, value in unit_file(text)["Service"]
        if k == "LoadCredential"
        for name, source in [value.split(":", 1)]
    }
    assert set(handed) == {tls.cert, tls.key}
    assert all(source.startswith("/etc/fenceproxy/tls/") for source in handed.values())


def test_the_unit_is_hardened() -> None:
    text = UNIT.read_text()
    hardening = {
        "DynamicUser": "yes",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",  # only the StateDirectory is writable
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "CapabilityBoundingSet": "",
        "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX",
    }
    assert {key: unit_setting(text, key) for key in hardening} == hardening


def unit_here(tmp_path: Path) -> Path:
    """A copy of the unit whose commands are the venv's fenceproxy."""
    text = UNIT.read_text()
    installed = shlex.split(unit_setting(text, "ExecStart"))[0]
    assert installed.endswith("/bin/fenceproxy")
    path = tmp_path / UNIT.name
    path.write_text(text.replace(installed, str(VENV_BIN / "fenceproxy")))
    return path


def systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        pytest.skip("systemd-analyze is not installed (Debian's systemd package has it)")
    return found


def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    path = unit_here(tmp_path)
    result = subprocess.run(
        [systemd_analyze(), "verify", str(path)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        cwd=tmp_path,
    )
    # A misspelt key or a bad value is only a warning, naming the file: none is allowed.
    about_it = [line for line in result.stderr.splitlines() if path.name in line]
    assert result.returncode == 0, result.stderr
    assert about_it == []


def test_systemd_analyze_rates_the_unit_well_hardened(tmp_path: Path) -> None:
    analyze = systemd_analyze()
    usage = subprocess.run([analyze, "--help"], capture_output=True, text=True, check=False)
    if "--offline" not in usage.stdout:
        pytest.skip("this systemd-analyze cannot rate a unit file offline (systemd < 250)")
    # The threshold is on a scale of 0 to 100: 20 is an exposure level of 2.0 ("OK").
    result = subprocess.run(
        [analyze, "security", "--offline=yes", "--threshold=20", str(unit_here(tmp_path))],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout.strip().splitlines()[-1]


@pytest.mark.slow
async def test_the_unit_commands_migrate_serve_reload_and_stop(tmp_path: Path) -> None:
    """ExecStartPre, ExecStart, ExecReload and KillSignal, run here: a SQLite file in
    a folder of the test's own instead of the StateDirectory."""
    text = UNIT.read_text()
    config_text = UNIT_CONFIG.read_text()
    config = tmp_path / "fenceproxy.yaml"
    config.write_text(with_certificates(config_text, tmp_path))
    store = f"sqlite:///{tmp_path / 'state' / 'fenceproxy.db'}"
    (tmp_path / "state").mkdir()
    secrets = secret_values(model(config_text))

    pre = shlex.split(unit_setting(text, "ExecStartPre"))
    assert pre[1:3] == ["migrate", "-c"]
    migrate = await asyncio.create_subprocess_exec(
        str(VENV_BIN / "fenceproxy"),
        *pre[1:3],
        str(config),
        "--store",
        store,
        env={"PATH": str(VENV_BIN), **secrets},
        stdout=subprocess.PIPE,
    )
    out, _ = await migrate.communicate()
    assert migrate.returncode == 0, out
    assert (tmp_path / "state" / "fenceproxy.db").exists()

    # ProxyProcess adds `serve -c FILE` to the command, and loopback addresses.
    assert shlex.split(unit_setting(text, "ExecStart"))[1:3] == ["serve", "-c"]
    proxy = ProxyProcess(
        config, free_port(), "--store", store, command=[str(VENV_BIN / "fenceproxy")], env=secrets
    )
    try:
        await proxy.start()
        assert proxy.process is not None
        reload = unit_setting(text, "ExecReload").replace("$MAINPID", str(proxy.process.pid))
        kill = await asyncio.create_subprocess_exec(*shlex.split(reload))
        assert await kill.wait() == 0
        async with asyncio.timeout(10):
            while "reloaded" not in proxy.output():
                await asyncio.sleep(0.05)
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{proxy.admin_url}/healthz") as healthy,
        ):
            assert healthy.status == 200  # still serving after the reload
        proxy.signal(signal.Signals[unit_setting(text, "KillSignal")])
        assert await proxy.wait(within=seconds(unit_setting(text, "TimeoutStopSec"))) == 0
    finally:
        await proxy.stop()


# --- the high-availability recipe (deploy/ha) ---------------------------------------


def ha_services() -> dict[str, dict[str, Any]]:
    services = yaml.safe_load((HA / "docker-compose.yml").read_text())["services"]
    assert isinstance(services, dict)
    return services


def ha_nodes() -> dict[str, dict[str, Any]]:
    """The PostgreSQL nodes: the services built from Dockerfile.patroni."""
    return {
        name: service
        for name, service in ha_services().items()
        if service.get("build", {}).get("dockerfile") == "deploy/ha/Dockerfile.patroni"
    }


def test_ha_proxies_name_every_patroni_node_and_require_a_synchronous_standby() -> None:
    services = ha_services()
    nodes = ha_nodes()
    assert len(nodes) == 3  # a synchronous standby is left after a failover
    config = model((HA / "fenceproxy.yaml").read_text())
    store = parse_store_url(config.store)
    assert store.require_sync
    addresses = {
        node["environment"]["PATRONI_POSTGRESQL_CONNECT_ADDRESS"] for node in nodes.values()
    }
    assert set(store.hosts) == addresses
    assert "target_session_attrs=read-write" in store.dsn
    proxies = [
        s
        for s in services.values()
        if s.get("volumes") == ["./fenceproxy.yaml:/etc/fenceproxy/fenceproxy.yaml:ro"]
    ]
    assert len(proxies) == 3  # migrate and two proxies
    for service in proxies:
        for secret in secrets_named(config):
            assert service["environment"][secret].startswith("${" + secret + ":?")
        assert store.password_env is not None
        for node in nodes.values():  # post-bootstrap.sh sets the role's password from it
            assert (
                node["environment"][store.password_env]
                == service["environment"][store.password_env]
            )
    for service in services.values():
        assert "ports" not in service or service in proxies  # only the proxies publish


def test_ha_patroni_uses_the_three_etcd_members_and_synchronous_mode() -> None:
    services = ha_services()
    patroni = yaml.safe_load((HA / "patroni.yml").read_text())
    members = [
        name for name, s in services.items() if s.get("image", "").startswith("quay.io/coreos/etcd")
    ]
    assert len(members) == 3
    assert patroni["etcd3"]["hosts"] == ",".join(f"{m}:2379" for m in members)
    cluster = services[members[0]]["environment"]["ETCD_INITIAL_CLUSTER"]
    assert cluster == ",".join(f"{m}=http://{m}:2380" for m in members)
    dcs = patroni["bootstrap"]["dcs"]
    assert dcs["synchronous_mode"] is True
    assert dcs["postgresql"]["use_pg_rewind"] is True
    assert dcs["ttl"] >= dcs["loop_wait"] + 2 * dcs["retry_timeout"]
    assert (HA / patroni["bootstrap"]["post_bootstrap"].rsplit("/", 1)[1]).exists()


@pytest.mark.skipif(
    shutil.which("patroni") is None or postgres_bin() is None,
    reason="Patroni and PostgreSQL are not installed (make servers installs them)",
)
def test_patroni_finds_nothing_wrong_in_the_recipe_but_names_only_compose_resolves(
    tmp_path: Path,
) -> None:
    node = ha_nodes()["pg0"]["environment"]
    recipe = yaml.safe_load((HA / "patroni.yml").read_text())
    environment = {
        "PATH": f"{Path(os.path.realpath(postgres_bin() / 'pg_ctl')).parent}:/usr/bin:/bin",
        **{k: v for k, v in node.items() if not v.startswith("${")},
        **{k: "secret" for k, v in node.items() if v.startswith("${")},
        # Each node has the ports of its listeners to itself in its container; here
        # they are the machine's (a PostgreSQL of its own may take 5432), so the
        # validator, which refuses a port in use, is given free ones: the same
        # addresses, another port.
        **{
            f"PATRONI_{section.upper()}_LISTEN": recipe[section]["listen"].rsplit(":", 1)[0]
            + f":{free_port()}"
            for section in ("restapi", "postgresql")
        },
    }
    result = subprocess.run(
        ["patroni", "--validate-config", str(HA / "patroni.yml")],
        capture_output=True, text=True, env=environment, check=False, timeout=60,
    )  # fmt: skip
    complaints = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    for line in complaints:
        # The nodes' and etcd members' names, which Compose's network resolves.
        assert "Name or service not known" in line or "is not reachable" in line, line
    assert any(line.startswith("etcd3.hosts") for line in complaints)


@pytest.mark.slow
async def test_the_post_bootstrap_script_makes_the_role_the_proxies_migrate_with(
    tmp_path: Path,
) -> None:
    """What Patroni runs once on a new cluster, on a real PostgreSQL whose superuser
    is ``postgres`` as in the image; then the recipe's store URL migrates there."""
    bin_dir = postgres_bin()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed")
    directory = Path(tempfile.mkdtemp(prefix="fenceproxy-postgres-"))
    server = PostgresServer(directory, bin_dir, user="postgres").init().start()
    try:
        config = model((HA / "fenceproxy.yaml").read_text())
        password_env = parse_store_url(config.store).password_env
        assert password_env is not None
        result = await asyncio.to_thread(
            subprocess.run,
            ["sh", str(HA / "post-bootstrap.sh"), server.url()],
            capture_output=True, text=True, check=False, timeout=60,
            env={**os.environ, password_env: "s3cret'; DROP ROLE postgres; --"},
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        role = server.url("fenceproxy").replace("postgres@", "fenceproxy@", 1)
        assert await migrate_store(role) == (0, SCHEMA_VERSION)
        conn = await asyncpg.connect(role)
        try:
            assert await conn.fetchval("SELECT pg_has_role('fenceproxy', 'pg_monitor', 'USAGE')")
            owner = "SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = 'fenceproxy'"
            assert await conn.fetchval(owner) == "fenceproxy"
        finally:
            await conn.close()
    finally:
        server.stop("immediate")
        shutil.rmtree(directory, ignore_errors=True)
