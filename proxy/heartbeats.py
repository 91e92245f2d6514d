"""Heartbeats from traffic, coalesced: at most one store write per run per second."""

from __future__ import annotations

import asyncio
import logging
import time

from .store import Store, StoreUnavailable

log = logging.getLogger("idemproxy.proxy")


class Heartbeats:
    def __init__(self, store: Store, interval: float = 1.0):
        self._store = store
        self._interval = interval
        self._pending: dict[tuple[str, str], float] = {}

    def beat(self, tenant: str, run: str) -> None:
        """Note that a run is alive; costs a dict write, never a store call."""
        self._pending[(tenant, run)] = time.time()

    async def flush(self) -> None:
        if not self._pending:
            return
        beats, self._pending = self._pending, {}
        try:
            await self._store.runs.touch(beats)
        except StoreUnavailable as exc:
            log.warning("heartbeats for %d run(s) not written: %s", len(beats), exc)
            for key, at in beats.items():  # keep the newest for the next flush
                self._pending[key] = max(at, self._pending.get(key, 0.0))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.flush()
            except Exception:  # noqa: BLE001 - without heartbeats, live runs look dead
                log.exception("heartbeat flush failed")
