"""The command line: ``fenceproxy serve | check-config | demo``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from aiohttp import web

from .app import make_app
from .config import Config, load_config, parse_listen
from .demo import run_demo
from .errors import ConfigError, FenceProxyError
from .log import access_log, server_log

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fenceproxy",
        description="A reverse proxy that refuses stale and duplicate fenced writes.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the proxy")
    serve.add_argument("-c", "--config", required=True, metavar="FILE", help="YAML config")
    serve.add_argument("--listen", metavar="HOST:PORT", help="override the file's listen")
    serve.add_argument("--store", metavar="URL", help="override the file's store")
    serve.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"])

    check = commands.add_parser("check-config", help="validate a config file and exit")
    check.add_argument("-c", "--config", required=True, metavar="FILE", help="YAML config")

    commands.add_parser("demo", help="run the worked example on loopback")
    return parser


def _load(args: argparse.Namespace) -> Config:
    overrides = {
        key: value for key in ("listen", "store") if (value := getattr(args, key, None)) is not None
    }
    return load_config(args.config, overrides)


def _serve(config: Config, log_level: str) -> None:
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    host, port = parse_listen(config.listen)
    server_log.info(
        "fenceproxy on http://%s:%d, store %s, %d route(s)",
        host,
        port,
        config.store,
        len(config.routes),
    )
    web.run_app(
        make_app(config),
        host=host,
        port=port,
        shutdown_timeout=config.shutdown_timeout,
        access_log=access_log,
        print=None,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        return asyncio.run(run_demo())
    try:
        config = _load(args)
        if args.command == "check-config":
            print(f"{args.config}: OK, {len(config.routes)} route(s)")
            return 0
        _serve(config, args.log_level)
    except ConfigError as exc:
        print(f"fenceproxy: config error\n{exc}", file=sys.stderr)
        return 2
    except FenceProxyError as exc:
        print(f"fenceproxy: {exc}", file=sys.stderr)
        return 1
    return 0
