"""The proxy's commands: ``serve`` and ``check`` (the supervisor's are in supervisor/commands.py)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Callable

import orjson

from .config_view import effective, to_toml
from .store import open_store, sqlite_path
from .config import Settings, mask_url
from .eventloop import run

Command = Callable[[Settings, argparse.Namespace], int]


def add_commands(sub, common: argparse.ArgumentParser, serve: Command) -> None:
    """Add ``serve`` (run by ``serve``, which the composition root gives) and ``check``."""
    p = sub.add_parser("serve", parents=[common], help="run the proxy (and the supervisor, unless disabled)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--workers", type=int, help="processes sharing the port (SO_REUSEPORT)")
    p.add_argument("--no-supervisor", action="store_true")
    p.set_defaults(handler=serve)
    p = sub.add_parser("check", parents=[common], help="check configuration and store; exit 0 when healthy")
    p.set_defaults(handler=check)
    p = sub.add_parser("config", parents=[common], help="print the effective configuration (secrets masked)")
    p.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    p.set_defaults(handler=show_config)


def show_config(settings: Settings, args: argparse.Namespace) -> int:
    """The settings after the file, IDEMPROXY_* variables and flags; touches no store."""
    tables = effective(settings)
    if args.json:
        sys.stdout.write(orjson.dumps(tables, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        sys.stdout.write(to_toml(tables))
    return 0


def check(settings: Settings, args: argparse.Namespace | None = None) -> int:
    """Configuration loads and the store answers: exit 0; otherwise print why, exit 1."""

    async def probe() -> int:
        fresh = _no_journal_yet(settings.store.url)
        if fresh is not None:
            return fresh
        try:  # once, without creating a journal: the real cause, at once, and nothing left behind
            store = await asyncio.wait_for(open_store(settings, attempts=1, create=False),
                                           settings.store.timeout * 3)
        except Exception as exc:  # noqa: BLE001 - any failure is an unhealthy answer
            reason = str(exc) or type(exc).__name__
            print(f"store {mask_url(settings.store.url)}: NOT reachable: {reason}", file=sys.stderr)
            return 1
        try:
            await store.ping()
        finally:
            await store.aclose()
        print(f"store {mask_url(settings.store.url)}: ok")
        print(f"durability: {store.durability}")
        for up in settings.upstreams.values():
            print(f"upstream {up.name}: {mask_url(up.url)}")
        return 0

    return run(probe)


def _no_journal_yet(url: str) -> int | None:
    """A SQLite journal not created yet: healthy when the proxy could create it (check
    creates nothing itself), else why not. None: there is a journal to open."""
    path = sqlite_path(url)
    if not path or Path(path).exists():
        return None
    folder = Path(path).parent
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        print(f"store {url}: NOT reachable: {folder} is not a folder the proxy can write in", file=sys.stderr)
        return 1
    print(f"store {url}: ok (no journal yet: the proxy creates {path} when it first starts)")
    return 0
