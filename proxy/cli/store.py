"""The commands about the store and the configuration: ``migrate``, ``check`` and ``config``."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

import orjson

from ...supervisor.credentials import missing_credentials
from ..config import ConfigError, Settings, mask_url
from ..config_view import effective, to_toml
from ..eventloop import run
from ..store import SchemaNotCurrent, open_store, sqlite_path
from .common import FAILED, MIGRATE_HINT, OK, command


def add_commands(sub, common: argparse.ArgumentParser) -> None:
    """Add ``migrate``, ``check`` and ``config``."""
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
    p.set_defaults(handler=check)
    p = command(sub, common, "config", "print the effective configuration (secrets masked)",
                "Print the settings after the file, IDEMPROXY_* variables and flags, secrets masked. "
                "Touches no store.")
    p.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    p.set_defaults(handler=show_config)


def show_config(settings: Settings, args: argparse.Namespace) -> int:
    """The settings after the file, IDEMPROXY_* variables and flags; touches no store."""
    tables = effective(settings)
    if args.json:
        sys.stdout.write(orjson.dumps(tables, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        sys.stdout.write(to_toml(tables))
    return OK


def check(settings: Settings, args: argparse.Namespace | None = None) -> int:
    """Configuration loads and the store answers with a current schema: exit 0; otherwise
    print why, exit 1. Writes nothing, on any store. Warnings (a command hook whose agents will
    start without a credential an upstream needs) are printed first, on stderr: they change no
    exit code."""
    where = f"store {mask_url(settings.store.url)}"
    for warning in missing_credentials(settings):
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
