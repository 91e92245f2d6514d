"""Commands that talk to a store: ``check``, and (from supervisor/) runs and journal."""

from __future__ import annotations

import asyncio
import sys

from .app import open_store
from .config import Settings, mask_url
from .server import run


def check(settings: Settings, args=None) -> int:
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


def add_subcommands(sub, command) -> None:
    from ..supervisor.cli import add_subcommands as add_run_commands  # supervise, runs, journal

    add_run_commands(sub, command)
