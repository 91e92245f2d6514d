"""The idemproxy command: serve the proxy, supervise runs, inspect runs and the journal."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from . import commands, server
from .config import ConfigError, Settings, load_settings

log = logging.getLogger("idemproxy")


def _settings(args: argparse.Namespace) -> Settings:
    overrides = {
        "server.host": getattr(args, "host", None),
        "server.port": getattr(args, "port", None),
        "server.workers": getattr(args, "workers", None),
        "store.url": getattr(args, "store", None),
    }
    if getattr(args, "no_supervisor", False):
        overrides["supervisor.enabled"] = False
    for item in getattr(args, "set", None) or []:
        dotted, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set wants section.option=value, got {item!r}")
        overrides[dotted.strip()] = value
    return load_settings(args.config, overrides=overrides)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="idemproxy", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        # IDEMPROXY_CONFIG lets a container image name its config file once for every
        # command (serve, supervise, check in a HEALTHCHECK) instead of in each argv.
        p.add_argument("--config", "-c", default=os.environ.get("IDEMPROXY_CONFIG") or None,
                       help="TOML file (default: $IDEMPROXY_CONFIG, else the embedded "
                            "config/default.toml)")
        p.add_argument("--set", action="append", metavar="SECTION.OPTION=VALUE",
                       help="override one option; may repeat")
        return p

    serve = command("serve", "run the proxy (and the supervisor, unless disabled)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--store", help="store URL: sqlite:///file.db, postgresql://..., redis://...")
    serve.add_argument("--workers", type=int, help="processes sharing the port (SO_REUSEPORT)")
    serve.add_argument("--no-supervisor", action="store_true")
    serve.set_defaults(handler=server.serve)
    check = command("check", "check configuration and store; exit 0 when healthy")
    check.add_argument("--store")
    check.set_defaults(handler=commands.check)
    commands.add_subcommands(sub, command)

    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        settings = _settings(args)
    except ConfigError as exc:
        print(f"idemproxy: configuration error: {exc}", file=sys.stderr)
        return 1 if args.command == "check" else 2  # 2 means something else to a HEALTHCHECK
    return args.handler(settings, args)


if __name__ == "__main__":
    sys.exit(main())
