"""Reading a config file: its YAML (a key given twice refused), validated into a
:class:`~fenceproxy.config.schema.Config`, its relative paths made absolute, and
every secret, certificate and the bodies' folder it names checked at once.

Every error names the file, the key (``routes[0].upstream``) and what is wrong, and
is raised as :class:`~fenceproxy.errors.ConfigError`, all of a file's at once.
"""

from __future__ import annotations

import difflib
import os
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError
from yarl import URL

from ..errors import ConfigError
from ..spool import SpoolFolder, default_folder
from ..store.url import absolute_store_url
from .material import (
    admin_credentials,
    lease_credentials,
    signing_keys,
    tls_contexts,
    tracing_headers,
)
from .schema import Config, SecretSpec, is_loopback, parse_listen

__all__ = ["load_config", "parse_config"]

S = TypeVar("S", bound=SecretSpec)


def _in_clear(config: Config) -> list[tuple[str, str]]:
    """What of ``config`` would cross a network in clear, by the key that would mend
    it: credentials and tokens that let their bearer act as someone, on a listener
    beyond loopback without TLS or sent to a collector beyond loopback over plain
    HTTP, unless ``allow_plaintext`` says the network is trusted; and a lease client
    named by a certificate without a CA to verify it."""
    problems = []
    leases = config.leases
    named = leases is not None and any(c.subject is not None for c in leases.clients)
    if named and (config.tls is None or config.tls.client_ca is None):
        problems.append((
            "tls.client_ca",
            "a lease client named by a certificate subject (leases.clients[].subject) "
            "needs the CA whose client certificates are verified",
        ))  # fmt: skip
    if config.allow_plaintext:
        return problems
    secrets = []
    if leases is not None and any(c.subject is None for c in leases.clients):
        secrets.append("the lease API's bearer credentials (leases.clients)")
    if config.signing is not None:
        secrets.append("signed fencing tokens (signing)")
    if secrets and config.tls is None and not is_loopback(parse_listen(config.listen)[0]):
        problems.append((
            "tls",
            f"{' and '.join(secrets)} would cross the network in clear on {config.listen}: "
            "give tls (a certificate and its key), listen on loopback, or set "
            "allow_plaintext: true for a network you trust",
        ))  # fmt: skip
    tracing = config.tracing
    if tracing is not None and any(isinstance(v, SecretSpec) for v in tracing.headers.values()):
        collector = URL(tracing.endpoint)
        if collector.scheme == "http" and not is_loopback(collector.host or ""):
            problems.append((
                "tracing.endpoint",
                f"the collector's credentials (tracing.headers) would cross the network in "
                f"clear to {collector.host}: give an https:// endpoint, a collector on "
                "loopback, or set allow_plaintext: true for a network you trust",
            ))  # fmt: skip
    admin = config.admin
    bare = admin is not None and config.admin_clients and config.admin_tls is None
    if bare and admin is not None and not is_loopback(parse_listen(admin)[0]):
        problems.append((
            "admin_tls",
            f"the admin listener's bearer credentials (admin_clients) would cross the "
            f"network in clear on {admin}: give admin_tls, listen on loopback, or set "
            "allow_plaintext: true for a network you trust",
        ))  # fmt: skip
    return problems


def _key(loc: tuple[int | str, ...]) -> str:
    """``("routes", 0, "upstream")`` to ``routes[0].upstream``, without pydantic's
    internal validator names nor a union's tags (``(secret)``, which no key has)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.startswith(("function-", "(")):
            out += f".{part}" if out else part
    return out


def _unknown_key(loc: tuple[int | str, ...]) -> str:
    """What to say of a key no model has at ``loc``: the closest known one, if any."""
    model: type[BaseModel] | None = Config
    for part in loc[:-1]:
        if isinstance(part, str) and model is not None and part in model.model_fields:
            model = _model_in(model.model_fields[part].annotation)
    known = list(model.model_fields) if model is not None else []
    close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
    if close:
        return f"unknown key; did you mean {close[0]!r}?"
    return "unknown key" + (f"; known keys here: {', '.join(known)}" if known else "")


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds, directly, optionally or as the items of a tuple."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if (found := _model_in(arg)) is not None:
            return found
    return None


def parse_config(
    data: Any,
    source: str,
    overrides: Mapping[str, str] | None = None,
    keep: Mapping[str, Any] | None = None,
) -> Config:
    """Validate already-parsed YAML. ``overrides`` come from the command line;
    ``keep`` maps dotted keys (``idempotency.ttl``) to the values they keep whatever
    the file says (a reload keeps what changes only with a restart)."""
    if not isinstance(data, dict):
        raise ConfigError(source, [("", "the top level must be a mapping of keys")])
    merged = {**data, **(overrides or {})}
    for dotted, value in (keep or {}).items():
        node = merged
        *parents, last = dotted.split(".")
        for part in parents:
            child = node.get(part)
            node[part] = node = dict(child) if isinstance(child, dict) else {}
        node[last] = value
    try:
        config = Config.model_validate(merged)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        locs = [err["loc"] for err in errors]
        problems = []
        for err in errors:
            # An error on a container is only the echo of one inside it.
            if any(len(o) > len(err["loc"]) and o[: len(err["loc"])] == err["loc"] for o in locs):
                continue
            key = _key(err["loc"])
            if overrides and key in overrides:
                key = f"{key} (from --{key})"
            msg = err["msg"].removeprefix("Value error, ")
            msg = msg.replace("Tuple", "List").replace("tuple", "list")
            if err["type"] == "extra_forbidden":
                msg = _unknown_key(err["loc"])
            problems.append((key, msg))
        raise ConfigError(source, problems) from None
    if problems := _in_clear(config):
        raise ConfigError(source, problems)
    return config


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping: PyYAML would keep
    the last one, so a second ``routes:`` would silently replace the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:
                raise yaml.constructor.ConstructorError(
                    None, None, "a mapping key must be a plain value", key_node.start_mark
                ) from None
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_config(
    path: str | Path,
    overrides: Mapping[str, str] | None = None,
    keep: Mapping[str, Any] | None = None,
) -> Config:
    """Read and validate a config file (``keep``: see :func:`parse_config`).

    A relative SQLite path in the file is resolved against the file's folder; one in
    ``overrides`` (``--store``) against the working directory.

    Raises ConfigError naming the file for an unreadable file, a YAML syntax error
    (with its line and column), or any invalid key.
    """
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(source, [("", f"cannot read: {exc}")]) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no arbitrary objects
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f"line {mark.line + 1}, column {mark.column + 1}: "
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(source, [("", f"{where}invalid YAML: {problem}")]) from None
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError) as exc:
        # PyYAML's constructors raise these for values such as `!!int 30s`, a
        # 5000-digit number or nesting too deep to build.
        detail = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise ConfigError(source, [("", f"invalid YAML value: {detail}")]) from None
    config = parse_config(data, source, overrides, keep)
    base = os.getcwd() if overrides and "store" in overrides else Path(path).parent
    update: dict[str, Any] = {"store": absolute_store_url(config.store, base)}
    folder = Path(path).parent.absolute()
    if config.signing is not None:
        keys = _absolute_files(config.signing.keys, folder)
        update["signing"] = config.signing.model_copy(update={"keys": keys})
    if config.leases is not None:
        clients = _absolute_files(config.leases.clients, folder)
        update["leases"] = config.leases.model_copy(update={"clients": clients})
    if config.admin_clients:
        update["admin_clients"] = _absolute_files(config.admin_clients, folder)
    if config.tracing is not None:
        headers = {
            name: value if isinstance(value, str) else _absolute_files((value,), folder)[0]
            for name, value in config.tracing.headers.items()
        }
        update["tracing"] = config.tracing.model_copy(update={"headers": headers})
    for key in ("tls", "admin_tls"):
        spec = getattr(config, key)
        if spec is not None:
            update[key] = _absolute_paths(spec, folder, ("cert", "key", "client_ca"))
    if any(route.tls is not None for route in config.routes):
        update["routes"] = tuple(
            route.model_copy(
                update={"tls": _absolute_paths(route.tls, folder, ("ca", "cert", "key"))}
            )
            if route.tls is not None
            else route
            for route in config.routes
        )
    # The folder in full, the default's too: what a reload compares and keeps.
    temp_path = str(folder / (config.limits.body_temp_path or default_folder()))
    update["limits"] = config.limits.model_copy(update={"body_temp_path": temp_path})
    config = config.model_copy(update=update)
    # Every secret present and well-formed, now; the folder for bodies usable.
    signing_keys(config.signing, source)
    lease_credentials(config.leases, source)
    admin_credentials(config, source)
    tls_contexts(config, source)
    tracing_headers(config.tracing, source)
    try:
        SpoolFolder(temp_path).prepare()
    except ValueError as exc:
        raise ConfigError(source, [("limits.body_temp_path", str(exc))]) from None
    return config


M = TypeVar("M", bound=BaseModel)


def _absolute_paths(spec: M, folder: Path, keys: tuple[str, ...]) -> M:
    """``spec`` with each of its file ``keys`` that is set made absolute against the
    config file's ``folder``."""
    update = {key: str(folder / value) for key in keys if (value := getattr(spec, key)) is not None}
    return spec.model_copy(update=update)


def _absolute_files(specs: tuple[S, ...], folder: Path) -> tuple[S, ...]:
    return tuple(
        spec if spec.file is None else spec.model_copy(update={"file": str(folder / spec.file)})
        for spec in specs
    )
