"""The command line: ``fenceproxy serve | check-config | migrate | demo | stand-in | keys |
lease | run | jobs | chaos``."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import (
    ConfigError,
    FenceProxyError,
    LeaseLost,
    LeaseRefused,
    LeaseServiceError,
    ListenError,
    StoreError,
)
from .jobs_cli import add_jobs_parser, run_jobs
from .log import access_log, configure_logging, server_log
from .run_cli import USAGE, add_run_parser, run_spec, run_under_lease, ttl

if TYPE_CHECKING:
    from .config import Config

# The commands that run the proxy or its store, and need its server libraries
# (pip install 'fenceproxy[server]'); the others need only the client's.
_SERVER_COMMANDS = frozenset({"serve", "check-config", "migrate", "demo", "stand-in", "chaos"})

__all__ = ["main"]


def _config_argument(command: argparse.ArgumentParser) -> None:
    command.add_argument("-c", "--config", required=True, metavar="FILE", help="YAML config")


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser, and each command's own (whose usage its errors print)."""
    parser = argparse.ArgumentParser(
        prog="fenceproxy",
        description="A reverse proxy that refuses stale and duplicate fenced writes.",
    )
    parser.add_argument("--version", action="version", version=f"fenceproxy {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="run the proxy",
        description="Run the proxy until SIGINT or SIGTERM (which let requests in flight "
        "finish). SIGHUP reloads the config file: routes, timeouts, limits and log "
        "settings change for the next request; a file that is not valid is refused and "
        "the running config stays.",
    )
    _config_argument(serve)
    serve.add_argument("--listen", metavar="HOST:PORT", help="override the file's listen")
    serve.add_argument("--store", metavar="URL", help="override the file's store")
    serve.add_argument(
        "--admin", metavar="HOST:PORT", help="override the file's admin listener ('off' for none)"
    )
    serve.add_argument(
        "--workers", metavar="N", help="override the file's workers (a number, or auto)"
    )
    serve.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"])
    serve.add_argument(
        "--access-log",
        action="store_true",
        help="log one line per request (off by default: it costs about a quarter of the "
        "throughput; refusals and failures are logged either way)",
    )
    serve.add_argument(
        "--loop",
        default="auto",
        choices=["auto", "uvloop", "asyncio"],
        help="the event loop: uvloop when installed (auto), or the standard one",
    )

    check = commands.add_parser(
        "check-config",
        help="validate a config file and exit",
        description="Check the file, the secrets it names and its store (a SQLite file's "
        "folder exists and is writable; a PostgreSQL database answers at this build's "
        "schema), without starting. Exit 0 when all hold, 2 otherwise. The addresses are "
        "not bound: a running proxy holds them.",
    )
    _config_argument(check)

    migrate = commands.add_parser(
        "migrate",
        help="create or update the store's schema (run before serve on PostgreSQL)",
        description="Bring the config's store to this fenceproxy's schema, in one "
        "transaction; a store already up to date is left as it is. Exit 0 on success, "
        "1 when the store cannot be reached or has a newer schema.",
    )
    _config_argument(migrate)
    migrate.add_argument("--store", metavar="URL", help="override the file's store")

    commands.add_parser("demo", help="run the worked example on loopback")
    stand_in = commands.add_parser(
        "stand-in",
        help="a stand-in for the API behind the proxy, to try the proxy with",
        description="Answer every request 200 with a small JSON body, and print one line "
        "per write received (the method, the path, the fencing headers and the body), "
        "until SIGINT or SIGTERM: a write the proxy refused never shows.",
    )
    stand_in.add_argument(
        "--listen", default="127.0.0.1:9000", metavar="HOST:PORT", help="default: %(default)s"
    )
    keys = commands.add_parser(
        "keys",
        help="make a key for signed fencing tokens",
        description="Print a new signing key (32 random bytes, base64url). Put it in an "
        "environment variable or a file the config's signing.keys names, never in the "
        "config itself.",
    )
    keys.add_argument("action", choices=["generate"])
    commands.add_parser(
        "chaos", help="fault-injection run with checked invariants (see: fenceproxy chaos -h)"
    )

    lease = commands.add_parser(
        "lease",
        help="claim, renew, complete, release or show a lease (for scripts in any language)",
        description="Print the lease service's JSON reply. Exit 0 on success, 1 when the "
        "service refuses (the problem is printed), 3 when it cannot be reached. When the "
        "lease API takes credentials, the credential is read from the environment variable "
        "FENCEPROXY_LEASE_TOKEN or from --token-file, never from the command line.",
    )
    lease.add_argument("action", choices=["claim", "renew", "complete", "release", "show"])
    lease.add_argument("job")
    lease.add_argument("--url", default="http://127.0.0.1:8080", help="the proxy's address")
    lease.add_argument("--prefix", default="/_leases")
    lease.add_argument(
        "--owner",
        help="who holds the lease (all but show; optional with a credential, whose name "
        "it qualifies)",
    )
    lease.add_argument("--token-file", metavar="FILE", help="a file holding the credential")
    lease.add_argument("--generation", type=int, help="the lease's generation (renew, ...)")
    lease.add_argument(
        "--ttl", type=ttl, help="how long the lease lasts: 30, 30s, 500ms, 5m (claim, renew)"
    )
    add_jobs_parser(commands)
    add_run_parser(commands)
    return parser, dict(commands.choices)


def _load(args: argparse.Namespace, keep: Mapping[str, Any] | None = None) -> Config:
    from .config import load_config

    overrides = {
        key: value
        for key in ("listen", "store", "admin", "workers")
        if (value := getattr(args, key, None)) is not None
    }
    return load_config(args.config, overrides, keep)


def _serve(config: Config, args: argparse.Namespace, argv: Sequence[str]) -> int:
    from .config import parse_listen
    from .ops.admin import page_url
    from .server.app import notify_systemd, serve
    from .server.workers import Seat, supervise, worker_argv
    from .store.url import parse_store_url

    logging.basicConfig(level=args.log_level, handlers=[logging.StreamHandler()])
    configure_logging(config.log_format, config.log_levels)
    host, port = parse_listen(config.listen)
    loop, loop_name = _event_loop(args.loop)
    seat = Seat.from_environment()
    if seat is None and config.workers > 1:
        with asyncio.Runner(loop_factory=loop) as runner:
            code = runner.run(
                supervise(
                    config,
                    worker_argv(argv),
                    lambda: notify_systemd("READY=1"),
                    lambda keep: _load(args, keep),
                )
            )
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as below
        return code

    # The operator page is the supervisor's with workers: its own line names it.
    page = page_url(config) if seat is None else None

    def listening() -> None:
        server_log.info(
            "fenceproxy on %s://%s:%d, %d route(s), store: %s, %s%s%s",
            "http" if config.tls is None else "https",
            host,
            port,
            len(config.routes),
            parse_store_url(config.store).describe(),
            loop_name,
            "" if seat is None else f", worker {seat.index} of {config.workers}",
            "" if page is None else f", operator page: {page}",
        )
        if seat is None:
            notify_systemd("READY=1")
        else:
            seat.ready()

    with asyncio.Runner(loop_factory=loop) as runner:
        runner.run(
            serve(
                config,
                access_log=access_log if args.access_log else None,
                ready=listening,
                reload=(args.config, lambda keep: _load(args, keep)),
                seat=seat,
            )
        )
    # The loop gave SIGHUP back to its default, which ends the process: a reload
    # asked for while it shuts down must not turn a clean exit into a killed one.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    return 0


def _event_loop(choice: str) -> tuple[Callable[[], asyncio.AbstractEventLoop], str]:
    """uvloop (about 10-15 % more throughput) when installed, unless told otherwise."""
    if choice != "asyncio":
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise FenceProxyError(
                    "--loop uvloop: uvloop is not installed (pip install 'fenceproxy[fast]')"
                ) from None
        else:
            return uvloop.new_event_loop, "uvloop"
    return asyncio.new_event_loop, "asyncio loop"


def _lease_token(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """The lease API credential: from --token-file, or FENCEPROXY_LEASE_TOKEN."""
    if args.token_file is None:
        return os.environ.get("FENCEPROXY_LEASE_TOKEN")
    try:
        return Path(args.token_file).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        parser.error(f"--token-file: cannot read {args.token_file}: {exc}")


def _lease(parser: argparse.ArgumentParser, args: argparse.Namespace, token: str | None) -> int:
    if args.action != "show" and not args.owner and token is None:
        parser.error(f"lease {args.action} needs --owner")
    if args.action in ("renew", "complete", "release") and args.generation is None:
        parser.error(f"lease {args.action} needs --generation")
    from .client import SyncLeaseClient

    try:
        client = SyncLeaseClient(args.url, prefix=args.prefix, token=token)
    except ValueError as exc:
        parser.error(f"--url: {exc}")
    with client:
        try:
            if args.action == "claim":
                reply = client.claim(args.job, args.owner, args.ttl).record
            elif args.action == "renew":
                reply = client.renew(args.job, args.owner, args.generation, args.ttl).record
            elif args.action == "show":
                reply = client.show(args.job)
            else:
                call = client.complete if args.action == "complete" else client.release
                reply = call(args.job, args.owner, args.generation)
        except LeaseRefused as exc:
            fence = exc.problem.get("fence_generation")
            if args.action == "show" and fence is not None:  # no lease, and yet fenced
                print(json.dumps({"job_id": args.job, "lease": None, "fence_generation": fence},
                                 indent=2))  # fmt: skip
                return 0
            print(json.dumps(exc.problem, indent=2))
            return 1
        except (LeaseServiceError, LeaseLost) as exc:
            print(f"fenceproxy: {exc}", file=sys.stderr)
            return 3
    print(json.dumps(reply, indent=2))
    return 0


def _run(argv: Sequence[str]) -> int:
    """``fenceproxy run``: a usage error exits 64 (EX_USAGE), not argparse's 2, which
    could be the command's own exit code."""
    parser, commands = _parser()
    command = commands["run"]
    try:
        args = parser.parse_args(argv)
        spec = run_spec(command, args, _lease_token(command, args))
    except SystemExit as exc:  # --help, or a usage error
        return USAGE if exc.code == 2 else 0
    return run_under_lease(spec)


def _stand_in(parser: argparse.ArgumentParser, listen: str) -> int:
    from .stand_in import run_stand_in

    try:
        return asyncio.run(run_stand_in(listen))
    except ValueError as exc:
        parser.error(f"--listen: {exc}")
    except ListenError as exc:
        print(f"fenceproxy: cannot start: {exc}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in _SERVER_COMMANDS:
        try:
            import aiohttp  # noqa: F401
            import pydantic  # noqa: F401
            import yaml  # noqa: F401
        except ImportError as exc:
            print(
                f"fenceproxy: {argv[0]} needs the proxy's libraries ({exc.name} is not "
                "installed): pip install 'fenceproxy[server]'",
                file=sys.stderr,
            )
            return 2
    if argv[:1] == ["chaos"]:
        from .chaos import main as chaos_main  # only this command needs it

        return chaos_main(argv[1:])
    if argv[:1] == ["run"]:
        return _run(argv)
    if argv[:1] == ["serve"]:
        # Until serve handles it, SIGHUP (a reload) would end the process.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    parser, commands = _parser()
    args = parser.parse_args(argv)
    command = commands[args.command]  # a usage error names this command's usage
    if args.command == "demo":
        from .demo import run_demo

        return asyncio.run(run_demo())
    if args.command == "stand-in":
        return _stand_in(command, args.listen)
    if args.command == "keys":
        from .fence.tokens import generate_key

        print(generate_key())
        return 0
    if args.command == "lease":
        return _lease(command, args, _lease_token(command, args))
    if args.command == "jobs":
        return run_jobs(command, args)
    from .store import check_store, migrate_store
    from .store.url import parse_store_url

    try:
        config = _load(args)
        if args.command == "check-config":
            asyncio.run(check_store(config.store))
            print(f"{args.config}: OK, {len(config.routes)} route(s)")
            return 0
        if args.command == "migrate":
            before, after = asyncio.run(migrate_store(config.store))
            where = parse_store_url(config.store).describe()
            if before == after:
                print(f"{where}: schema version {after}, up to date")
            else:
                print(f"{where}: schema version {before} -> {after}")
            return 0
        return _serve(config, args, argv)
    except ConfigError as exc:
        print(f"fenceproxy: config error\n{exc}", file=sys.stderr)
        return 2
    except (ListenError, StoreError) as exc:
        if args.command == "migrate":
            print(f"fenceproxy: {exc}", file=sys.stderr)
            return 1
        if args.command == "check-config":
            print(f"fenceproxy: {args.config}: store: {exc}", file=sys.stderr)
            return 2
        # serve could not start: where it listens or where it keeps its state.
        print(f"fenceproxy: cannot start: {exc}", file=sys.stderr)
        return 2
    except FenceProxyError as exc:
        print(f"fenceproxy: {exc}", file=sys.stderr)
        return 1
    return 0
