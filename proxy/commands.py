"""The proxy's commands: ``serve`` and ``check`` (the supervisor's are in supervisor/commands.py)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Callable

from .store import open_store
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


def check(settings: Settings, args: argparse.Namespace | None = None) -> int:
    """Configuration loads and the store answers: exit 0; otherwise print why, exit 1."""

    async def probe() -> int:
        try:
            store = await asyncio.wait_for(open_store(settings), settings.store.timeout * 3)
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
