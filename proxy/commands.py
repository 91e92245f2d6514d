"""The proxy's commands: ``serve``, ``migrate``, ``check`` and ``config`` (the supervisor's
are in supervisor/commands.py)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Callable

import orjson

from .config_view import effective, to_toml
from .config import ConfigError, Settings, mask_url
from .store import SchemaNotCurrent, open_store, sqlite_path
from .eventloop import run

Command = Callable[[Settings, argparse.Namespace], int]

# Exit codes of every command (documented in the CLI reference)
OK, FAILED, CONFIG_ERROR = 0, 1, 2  # 2 is also argparse's, for a command line it cannot parse
MIGRATE_HINT = "run `idemproxy migrate`, or start `idemproxy serve`, which migrates"


def add_commands(sub, common: argparse.ArgumentParser, serve: Command,
                 advise: Callable[[Settings], list[str]] | None = None) -> None:
    """Add ``serve`` (run by ``serve``, which the composition root gives), ``migrate``,
    ``check`` (printing the warnings ``advise`` gives, from the composition root too) and
    ``config``."""
    p = command(sub, common, "serve", "run the proxy (and the supervisor, unless disabled)",
                "Run the proxy: bring the store's schema up to date, then listen. The supervisor "
                "runs in the same process unless --no-supervisor or [supervisor] enabled = false. "
                "A store that is not reachable yet is retried with backoff; one that refuses the "
                "configuration (no such database or folder) stops the start at once.")
    p.add_argument("--host", help="address to listen on (default [server] host, 127.0.0.1)")
    p.add_argument("--port", type=port, help="port to listen on, 0 for any free one (default 8787)")
    p.add_argument("--workers", type=int, help="processes sharing the port (SO_REUSEPORT)")
    p.add_argument("--no-supervisor", action="store_true", help="run the proxy alone")
    p.set_defaults(handler=serve)
    p = command(sub, common, "migrate", "create the store's schema, or bring it up to date",
                "Create the store's tables (SQLite, PostgreSQL), or apply the migrations an older "
                "schema lacks; nothing to do on Redis. `serve` and `supervise` do the same at start; "
                "`check` and the runs and journal commands never do.")
    p.set_defaults(handler=migrate)
    p = command(sub, common, "check", "check configuration and store, writing nothing; exit 0 when healthy",
                "Load the configuration and open the store without writing to it: exit 0 when the "
                "store answers and its schema is current; 1 when it is unreachable, refuses the "
                "configuration, or has no schema or an older one (run `idemproxy migrate`); 2 when "
                "the configuration is invalid. Meant for health checks (Docker HEALTHCHECK, "
                "Kubernetes exec probes: any non-zero exit is unhealthy). Warnings (a command hook "
                "whose agents will start without a credential an upstream needs) go to stderr and "
                "change no exit code.")
    p.set_defaults(handler=lambda settings, args: check(settings, args, advise))
    p = command(sub, common, "config", "print the effective configuration (secrets masked)",
                "Print the settings after the file, IDEMPROXY_* variables and flags, secrets masked. "
                "Touches no store.")
    p.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    p.set_defaults(handler=show_config)


def command(sub, common: argparse.ArgumentParser, name: str, summary: str, description: str):
    """A subcommand: ``summary`` in ``idemproxy --help``, ``description`` in its own."""
    return sub.add_parser(name, parents=[common], help=summary, description=description)


def port(text: str) -> int:
    """--port: 0 (any free port) to 65535."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0-65535, 0 for any free one)")
    return value


def show_config(settings: Settings, args: argparse.Namespace) -> int:
    """The settings after the file, IDEMPROXY_* variables and flags; touches no store."""
    tables = effective(settings)
    if args.json:
        sys.stdout.write(orjson.dumps(tables, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        sys.stdout.write(to_toml(tables))
    return OK


def check(settings: Settings, args: argparse.Namespace | None = None,
          advise: Callable[[Settings], list[str]] | None = None) -> int:
    """Configuration loads and the store answers with a current schema: exit 0; otherwise
    print why, exit 1. Writes nothing, on any store. ``advise``'s warnings are printed first,
    on stderr: they change no exit code."""
    where = f"store {mask_url(settings.store.url)}"
    for warning in advise(settings) if advise is not None else ():
        print(f"warning: {warning}", file=sys.stderr)

    async def probe() -> int:
        try:  # once: the real cause, at once, and nothing left behind
            store = await asyncio.wait_for(open_store(settings, attempts=1, migrate=False),
                                           settings.store.timeout * 3)
        except SchemaNotCurrent as exc:
            print(f"{where}: schema missing or out of date ({exc}): {MIGRATE_HINT}", file=sys.stderr)
            return FAILED
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure is an unhealthy answer
            reason = str(exc) or type(exc).__name__
            print(f"{where}: NOT reachable: {reason}", file=sys.stderr)
            return FAILED
        try:
            await store.ping()
        finally:
            await store.aclose()
        print(f"{where}: ok")
        print(f"durability: {store.durability}")
        for up in settings.upstreams.values():
            print(f"upstream {up.name}: {mask_url(up.url)}")
        return OK

    return _sqlite_folder_missing(settings.store.url) or run(probe)


def _sqlite_folder_missing(url: str) -> int:
    """A SQLite journal whose folder the proxy could not create it in: say so (FAILED);
    else 0, and the store is opened."""
    path = sqlite_path(url)
    if not path or Path(path).exists():
        return OK
    folder = Path(path).parent
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        print(f"store {url}: NOT reachable: {folder} is not a folder the proxy can write in", file=sys.stderr)
        return FAILED
    return OK


def migrate(settings: Settings, args: argparse.Namespace | None = None) -> int:
    """Bring the store's schema up to date (``serve`` does the same at start)."""
    where = f"store {mask_url(settings.store.url)}"

    async def work() -> int:
        try:
            store = await open_store(settings, migrate=False)
            print(f"{where}: schema up to date, nothing to do")
        except SchemaNotCurrent as exc:
            store = await open_store(settings)
            print(f"{where}: migrated (was: {exc})")
        await store.aclose()
        return OK

    return run(work)
