"""Heartbeats from traffic, coalesced: at most one store write per run per second.

A request is a beat when it arrives, and a run is alive for as long as a request of its
current attempt is open here (docs/restarts.md): the handler ``hold``s each request of a run once it
is let through, and every flush beats for the held requests still being answered whose
client is still connected, however long the upstream takes or a stream idles between
events. A request answered, or whose client left, beats no more; neither does a proxy that
died, so its open requests stop counting and silence (``timeout_s``) decides. Each beat
carries its attempt's epoch: the store ignores a superseded attempt's (``RunRegistry.touch``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref

from aiohttp import web

from .errors import client_gone
from .identity import Identity
from .store import Store, StoreUnavailable

log = logging.getLogger("idemproxy.proxy")

Beat = tuple[str, str, "int | None"]  # (namespace, run, epoch); None: calls that name no epoch


class Heartbeats:
    def __init__(self, store: Store, interval: float = 1.0):
        self._store = store
        self._interval = interval
        self._pending: dict[Beat, float] = {}
        # held requests by id: weakly, so one answered is freed as soon as aiohttp lets it go
        self._open: dict[int, tuple[weakref.ref[web.BaseRequest], Beat]] = {}

    def beat(self, namespace: str, run: str, epoch: int | None = None) -> None:
        """Note that a run is alive; costs a dict write, never a store call."""
        self._pending[(namespace, run, epoch)] = time.time()

    def hold(self, request: web.BaseRequest, ident: Identity) -> None:
        """``request`` is open for ``ident``'s run: it beats at every flush until it is
        answered or its client goes away."""
        self._open[id(request)] = (weakref.ref(request), (ident.namespace, ident.run, ident.epoch))

    def _beat_open(self) -> None:
        now = time.time()
        for key, (ref, beat) in list(self._open.items()):
            request = ref()
            # aiohttp lets go of a request's task once it is answered (web_protocol.start)
            if request is None or request.task is None or client_gone(request):
                del self._open[key]
            else:
                self._pending[beat] = now

    async def flush(self) -> None:
        self._beat_open()
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
