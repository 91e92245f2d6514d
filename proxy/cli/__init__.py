"""The idemproxy command, and the composition root: the one package where the proxy and the
supervisor meet. Its modules build parts and hand them to each other; no part imports the
other's package. The runs service (proxy/runs) fires hooks through the supervisor's ``Hooks``,
and the supervisor's loop runs beside the proxy app in ``serve`` (serving.py).

    serving.py   serve, supervise        store.py     migrate, check, config
    runs.py      runs list|show|...      journal.py   journal list|show|find|resolve
    common.py    exit codes, the runs service for a command; describe.py: tables for people
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys
from importlib.metadata import PackageNotFoundError, version

from ..config import ConfigError, Settings, load_settings, mask_url, unknown_variables
from ..store import SchemaNotCurrent, StoreError
from . import journal, runs, serving, store
from .common import CONFIG_ERROR, FAILED, MIGRATE_HINT

log = logging.getLogger("idemproxy")


def common_options() -> argparse.ArgumentParser:
    """Options every command takes, declared once. SUPPRESS: a value given before a
    subcommand's name stays when the subcommand does not repeat it."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", "-c", default=argparse.SUPPRESS,
                        help="TOML file (default: $IDEMPROXY_CONFIG, else the embedded config/default.toml)")
    common.add_argument("--set", action="append", default=argparse.SUPPRESS,
                        metavar="SECTION.OPTION=VALUE", help="override one option; may repeat")
    common.add_argument("--store", default=argparse.SUPPRESS,
                        help="store URL: sqlite:///file.db, postgresql://..., redis://...")
    return common


def settings_from(args: argparse.Namespace) -> Settings:
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
    # IDEMPROXY_CONFIG lets a container image name its config file once for every
    # command (serve, supervise, check in a HEALTHCHECK) instead of in each argv.
    config = getattr(args, "config", None) or os.environ.get("IDEMPROXY_CONFIG") or None
    return load_settings(config, overrides=overrides)


def _version() -> str:
    try:
        return version("idemproxy")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


DESCRIPTION = """An idempotency proxy for AI agents: it journals their side-effecting HTTP calls,
replays them when a restarted agent repeats them, and supervises their runs."""
EPILOG = """exit codes (every command):
  0  done; for check: the store answers and its schema is current
  1  failed: the store is unreachable, refuses the configuration or lacks its schema,
     the port is taken, or the command was refused (no such run, not quarantined)
  2  the command line or the configuration is invalid

Run `idemproxy COMMAND --help` for a command's options."""
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# Commands that run for long, and say what they are doing; the others print only their output.
TALKATIVE = ("serve", "supervise", "migrate")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="idemproxy", description=DESCRIPTION, epilog=EPILOG,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, metavar="LEVEL",
                     help="DEBUG, INFO, WARNING, ERROR or CRITICAL (default: INFO for serve, supervise "
                     "and migrate; WARNING for the others, which print only their output)")
    top.add_argument("--version", action="version", version=f"idemproxy {_version()}")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = common_options()
    serving.add_serve(sub, common)
    store.add_commands(sub, common)
    serving.add_supervise(sub, common)
    runs.add_commands(sub, common)
    journal.add_commands(sub, common)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    level = args.log_level or ("INFO" if args.command in TALKATIVE else "WARNING")
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    for name in unknown_variables(os.environ):
        log.warning("%s is not an idemproxy option and is ignored (idemproxy config shows what is set)", name)
    try:
        settings = settings_from(args)
    except ConfigError as exc:
        print(f"idemproxy: configuration error: {exc}", file=sys.stderr)
        return CONFIG_ERROR
    try:
        return args.handler(settings, args)
    except ConfigError as exc:  # found only when starting (the store URL, OTEL_* variables)
        print(f"idemproxy: configuration error: {exc}", file=sys.stderr)
        return CONFIG_ERROR
    except SchemaNotCurrent as exc:
        print(f"idemproxy: store {mask_url(settings.store.url)}: schema missing or out of date ({exc}): "
              f"{MIGRATE_HINT}", file=sys.stderr)
        return FAILED
    except StoreError as exc:
        print(f"idemproxy: store {mask_url(settings.store.url)}: {exc}", file=sys.stderr)
        return FAILED
    except OSError as exc:  # the port is taken, or the address is not ours
        where = f"{settings.server.host}:{settings.server.port}"
        reason = "the port is in use" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
        print(f"idemproxy: cannot listen on {where}: {reason}", file=sys.stderr)
        return FAILED

