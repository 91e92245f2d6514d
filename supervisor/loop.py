"""The supervisor: a small loop that restarts runs gone silent (SPEC §8).

Every ``[supervisor] interval_s`` it asks the store for running runs silent for longer
than their ``timeout_s`` (and past the ``grace_s`` that follows each start), and for each:

- claims the restart with a compare-and-set on the epoch (``Store.new_attempt``), so
  among many supervisors sharing a store exactly one restarts it, and the new epoch
  fences the old attempt; then fires the run's hook;
- backs off exponentially: the k-th restart within ``restart_window_s`` waits
  ``backoff_base_s * 2**(k-2)`` (at most ``backoff_max_s``) beyond the silence itself;
- gives up after ``max_restarts`` restarts within the window (OTP-style intensity): the
  run becomes ``dead`` and the ``on_dead`` hook fires. So does a silent run that has no
  hook at all, since nothing could start it again. The restarts are counted from the
  run's ``restart_times``, which the store keeps to the window, not from its history,
  which hook and backoff events would push them out of.

Signal handlers only set an event; a tick in progress always finishes, so a claimed
restart is never left without its hook.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from aiohttp import web

from ..proxy.config import Settings
from ..proxy.metrics import Metrics
from ..proxy.store import Store, StoreUnavailable
from ..proxy.store.base import Run, RunState
from .hooks import HookCall, Hooks

log = logging.getLogger("idemproxy.supervisor")

RESTART = "restart"  # the history event of a supervisor's restart


async def restart_run(store: Store, hooks: Hooks, run: Run, proxy_url: str, *, reason: str,
                      expected_epoch: int | None, now: float | None = None,
                      window_s: float | None = None) -> Run | None:
    """Start a new attempt of ``run`` and fire its hook; None if the claim was lost.

    ``expected_epoch`` makes the claim a compare-and-set (the supervisor's case); None
    restarts whatever the current epoch is (an operator's restart). ``window_s`` counts
    the restart towards ``max_restarts`` (the supervisor's restarts do; an operator's do not).
    """
    now = time.time() if now is None else now
    new = await store.runs.new_attempt(run.namespace, run.run_id, expected_epoch, now, reason, restart=True,
                                  window_s=window_s)
    if new is None:
        return None
    log.info("run %s/%s restarted (%s): epoch %d, restart %d", new.namespace, new.run_id, reason,
             new.epoch, new.restarts)
    await hooks.fire(new.hook, HookCall(RESTART, new.namespace, new.run_id, new.epoch, new.restarts,
                                        proxy_url))
    return new


class Supervisor:
    """Finds silent runs and restarts them; one instance per process, many per store."""

    def __init__(self, store: Store, settings: Settings, hooks: Hooks,
                 metrics: Metrics | None = None):
        self.store = store
        self.settings = settings
        self.hooks = hooks
        self.metrics = metrics

    async def run(self, stop: asyncio.Event) -> None:
        """Tick every ``interval_s`` until ``stop`` is set."""
        interval = self.settings.supervisor.interval_s
        log.info("supervisor watching %r every %.2fs", self.store, interval)
        while not stop.is_set():
            try:
                await self.tick()
            except StoreUnavailable as exc:
                log.warning("supervisor tick skipped: %s", exc)
            except Exception:  # noqa: BLE001 - one bad run must not stop the supervision of all
                log.exception("supervisor tick failed")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
        log.info("supervisor stopped")

    async def tick(self, now: float | None = None) -> list[tuple[str, str]]:
        """One pass: what was done, as (run_id, action) pairs."""
        now = time.time() if now is None else now
        done = []
        for run in await self.store.runs.silent(now):
            action = await self._handle_silent(run, now)
            if action:
                done.append((run.run_id, action))
        return done

    async def _handle_silent(self, run: Run, now: float) -> str | None:
        if not run.hook:
            return await self._bury(run, now, "silent, and no hook can start it again")
        window = self.settings.runs.restart_window_s
        restarts = recent_restarts(run.restart_times, now, window)
        if len(restarts) >= run.max_restarts:
            return await self._bury(run, now, f"{len(restarts)} restarts within {window:g}s")
        delay = self.backoff(len(restarts))
        if delay and run.next_restart_at <= max(restarts):  # not yet scheduled since the last one
            await self.store.runs.set_state(run.namespace, run.run_id, None, now,
                                           {"event": "backoff", "epoch": run.epoch, "delay_s": delay},
                                           next_restart_at=now + delay)
            return "backoff"
        new = await restart_run(self.store, self.hooks, run, self.settings.proxy_url, reason=RESTART,
                                expected_epoch=run.epoch, now=now, window_s=window)
        if new is None:
            return None  # another supervisor restarted it, or it ended meanwhile
        if self.metrics is not None:
            self.metrics.restarts.inc()
        return "restart"

    def backoff(self, restarts: int) -> float:
        """Extra wait before the next restart, given the restarts already in the window."""
        if restarts == 0:
            return 0.0
        runs = self.settings.runs
        return min(runs.backoff_base_s * 2 ** (restarts - 1), runs.backoff_max_s)

    async def _bury(self, run: Run, now: float, why: str) -> str | None:
        # Fenced by the epoch found silent: an attempt started meanwhile is not buried.
        ended = await self.store.runs.end(run.namespace, run.run_id, RunState.DEAD, now, epoch=run.epoch)
        # end_run is idempotent: the run carries our ``now`` only if this call ended it,
        # so among several supervisors exactly one fires on_dead.
        if ended is None or ended.state != RunState.DEAD or ended.ended_at != now:
            return None
        log.warning("run %s/%s is dead: %s", run.namespace, run.run_id, why)
        await self.store.runs.set_state(run.namespace, run.run_id, None, now,
                                       {"event": "why-dead", "epoch": run.epoch, "detail": why})
        on_dead = self.settings.runs.on_dead
        if on_dead:
            await self.hooks.fire(on_dead, HookCall(RunState.DEAD, run.namespace, run.run_id, run.epoch,
                                                    run.restarts, self.settings.proxy_url))
        return "dead"


def recent_restarts(restart_times: list[float], now: float, window: float) -> list[float]:
    """The restart times within ``window`` seconds before ``now``."""
    return [at for at in restart_times if at > now - window]


async def supervisor_task(app: web.Application, settings: Settings) -> None:
    """The supervisor in-process in ``idemproxy serve``, on the app's store and the hooks of
    its runs API (:func:`supervisor.routes`); stops on cancel."""
    from ..proxy.app import METRICS, STORE
    from .api import HOOKS

    stop = asyncio.Event()
    loop = asyncio.create_task(Supervisor(app[STORE], settings, app[HOOKS], app.get(METRICS)).run(stop))
    try:
        await asyncio.shield(loop)
    except asyncio.CancelledError:
        stop.set()  # graceful: the tick in progress finishes, claims get their hooks
        await loop
        raise
