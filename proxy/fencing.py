"""Fencing: a request of a superseded attempt (a zombie) is refused before anything is forwarded.

A run-scoped request names its run and, usually, its attempt's epoch. The store keeps each
run's current epoch; a request of an older epoch gets 412 ``stale-epoch``, one further than
the next gets 409 ``epoch-ahead``, and the first request of a run registers it with the
``[runs]`` defaults. A request that passes is the run's heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
import time

from .config import Settings
from .heartbeats import Heartbeats
from .identity import Identity
from .problems import Problem
from .runs.endings import superseded_ending
from .store import Store, StoreUnavailable
from .store.base import Run

log = logging.getLogger("idemproxy.proxy")


class Fence:
    def __init__(self, settings: Settings, store: Store, heartbeats: Heartbeats):
        self._settings, self._store, self._heartbeats = settings, store, heartbeats
        self._epoch_reads: dict[tuple, asyncio.Future] = {}  # shared by the requests of one attempt

    async def check(self, ident: Identity, fail_open: bool) -> None:
        """Refuse a superseded attempt, or one ahead of the run.

        A passthrough request records nothing, so when the store is down it goes on
        unfenced (``fail_open``; docs/guarantees.md, "Fail closed"); a record request fails
        closed.
        """
        try:
            current = await self._observe_epoch(ident)
        except StoreUnavailable:
            if not fail_open:
                raise
            log.warning("store unavailable: passthrough for run %s forwarded unfenced", ident.run)
            return
        if ident.epoch is not None and ident.epoch < current:
            raise Problem("stale-epoch", f"run {ident.run} is at epoch {current}; this attempt "
                          f"(epoch {ident.epoch}) has been superseded", epoch=current)
        if ident.epoch is not None and ident.epoch > current:  # the store raises it by one at most
            raise Problem("epoch-ahead", f"run {ident.run} is at epoch {current}; a request may start "
                          f"epoch {current + 1} at most, not {ident.epoch} (POST /runs/{ident.run}/attempts "
                          "starts the next attempt)", epoch=current)
        self._heartbeats.beat(ident.namespace, ident.run, ident.epoch)  # a fenced zombie is no sign of life

    async def _observe_epoch(self, ident: Identity) -> int:
        """The run's current epoch. Requests of one attempt that arrive together share one
        store call (in flight for a round trip), so a busy run costs the store one read per
        round trip, not one per request; only that call needs the run's defaults (a run
        seen first is registered with them)."""
        key = (ident.namespace, ident.run, ident.epoch)
        shared = self._epoch_reads.get(key)
        if shared is None:
            shared = self._epoch_reads[key] = asyncio.ensure_future(self._store.runs.observe_epoch(
                ident.namespace, ident.run, ident.epoch, self._defaults(ident), time.time(),
                ended=None if ident.epoch is None else superseded_ending(by_request=ident.epoch)))
            shared.add_done_callback(lambda _: self._epoch_reads.pop(key, None))
        return await asyncio.shield(shared)

    def _defaults(self, ident: Identity) -> Run:
        runs = self._settings.runs
        # traffic arms no hook by itself: the [runs] hook only where its tenants may (README)
        return Run(ident.namespace, ident.run, timeout_s=runs.timeout_s, grace_s=runs.grace_s,
                   max_restarts=runs.max_restarts, hook=self._settings.default_hook(ident.namespace))
