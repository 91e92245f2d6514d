"""The supervisor: a small loop that restarts runs gone silent (docs/restarts.md).

Every ``[supervisor] interval_s`` it asks the store for running runs silent for longer
than their ``timeout_s`` (and past the ``grace_s`` that follows each start), or whose
attempt was found lost (its hook-started process exited, its held connection stayed gone:
the store rings every supervisor, which then ticks at once). The store finds them by an
index of when each run is due, so a tick costs what is due, not what is live; it hands
them out in batches of ``BATCH`` (no more than this supervisor may restart), ``SILENT_LIMIT`` a
tick at most, each claimed by this supervisor until it is handled (``CLAIM_S`` at most), so
replicas share a mass silence instead of all reading it. It handles ``HANDLED_AT_ONCE`` of
them at a time. For each:

- claims the restart with a compare-and-set on the epoch (``RunsService.restart``), so
  among many supervisors sharing a store exactly one restarts it, and the new epoch
  fences the old attempt; then fires the run's hook;
- backs off exponentially: the k-th restart within ``restart_window_s`` waits
  ``backoff_base_s * 2**(k-2)`` (at most ``backoff_max_s``) beyond the silence itself;
- stays within its own bounds: at most ``max_restarts_per_minute`` restarts over any minute
  and ``max_hook_processes`` hook processes at once; a silent run beyond them waits, silent,
  for a later tick (nothing claimed, nothing counted);
- gives up after ``max_restarts`` restarts within the window (OTP-style intensity): the
  run becomes ``dead``. So does a silent run that has no hook at all, since nothing could
  start it again. The ``on_dead`` hook fires for a dead run whose hook was armed or whose
  namespace that hook allows, never for runs traffic made up. The restarts are counted from the
  run's ``restart_times``, which the store keeps to the window, not from its history,
  which hook and backoff events would push them out of.

Each restart and each burial records how the attempt before ended (``ended`` in the run's
history: its process's exit, its held connection's drop, or its silence, with the last
lines of its log; proxy/runs/endings.py), in the same store change.

Signal handlers only set an event; a tick in progress always finishes, so a claimed
restart is never left without its hook.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

from ..proxy.config import Settings
from ..proxy.observability.metrics import Metrics
from ..proxy.runs.endings import supervisor_ending, with_log_tail
from ..proxy.runs.service import RESTART, RunsService
from ..proxy.store import StoreUnavailable
from ..proxy.store.model import Run, RunState
from ..proxy.store.rules import SILENT_LIMIT
from .credentials import missing_credentials

log = logging.getLogger("idemproxy.supervisor")
DEFERRED = "deferred"  # a restart left for a later tick: this supervisor is at its bounds
# Runs a tick handles at once: each restart waits on its own store writes (a commit each),
# so one at a time would make a mass silence take a round trip per run, in sequence
HANDLED_AT_ONCE = 16
# Runs claimed at a time: a few rounds of HANDLED_AT_ONCE, so that supervisors ticking
# together split a mass silence finely instead of one taking a thousand at once
BATCH = 4 * HANDLED_AT_ONCE
# How long a supervisor's claim on the runs it read lasts (at least its interval): long enough
# to handle them all; should it die meanwhile, the other replicas restart them after that
CLAIM_S = 10.0


class Supervisor:
    """Finds silent runs and restarts them; one instance per process, many per store."""

    def __init__(self, runs: RunsService, settings: Settings, metrics: Metrics | None = None):
        self.runs = runs
        self.store = runs.store
        self.settings = settings
        self.metrics = metrics
        self._restarted: collections.deque[float] = collections.deque()  # this minute's restarts
        self._starting = 0  # restarts under way: counted against the bounds before they are made

    async def run(self, stop: asyncio.Event) -> None:
        """Tick every ``interval_s`` until ``stop`` is set."""
        interval = self.settings.supervisor.interval_s
        log.info("supervisor watching %r every %.2fs", self.store, interval)
        for warning in missing_credentials(self.settings):  # as `idemproxy check` says, at start
            log.warning("%s", warning)
        self.runs.launcher.keep_standbys()  # hooks' processes started ahead live as long as we do
        try:
            while not stop.is_set():
                try:
                    await self.tick()
                except StoreUnavailable as exc:
                    log.warning("supervisor tick skipped: %s", exc)
                except Exception:  # noqa: BLE001 - one bad run must not stop the supervision of all
                    log.exception("supervisor tick failed")
                await self._pause(stop, interval)
        finally:
            await self.runs.launcher.stop_standbys()
        log.info("supervisor stopped")

    async def _pause(self, stop: asyncio.Event, interval: float) -> None:
        """Wait ``interval`` before the next tick; less when ``stop`` is set or an attempt is
        found lost (its process exited, its held connection stayed gone), here or, heard
        through the store, on any replica."""
        stopping = asyncio.ensure_future(stop.wait())
        lost = asyncio.ensure_future(self.store.runs.wait_lost(interval))
        try:
            await asyncio.wait({stopping, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            lost.cancel()

    async def tick(self, now: float | None = None) -> list[tuple[str, str]]:
        """One pass: what was done, as (run_id, action) pairs. ``now``: the time of the whole
        pass (tests), else the clock's at each batch."""
        done: list[tuple[str, str]] = []
        deferred: list[Run] = []
        read = 0
        # Batches of runs due, each claimed: supervisors ticking together take their share
        # batch by batch, until a batch comes back short, one is deferred or SILENT_LIMIT were
        # read. A batch holds no more than this supervisor may still restart this minute (one
        # at least: runs to bury need no room); what it defers is let go at once, for a
        # replica with room. The restart itself is decided by the epoch's compare-and-set.
        while read < SILENT_LIMIT and not deferred:
            at = time.time() if now is None else now
            limit = max(1, min(BATCH, SILENT_LIMIT - read, self._room(at)))
            batch = await self.store.runs.silent(at, limit,
                                                 claim_s=max(self.settings.supervisor.interval_s, CLAIM_S))
            read += len(batch)
            for run, action in await self._handle_batch(batch, at):
                done.append((run.run_id, action))
                if action == DEFERRED:
                    deferred.append(run)
            if len(batch) < limit:
                break
        for run in deferred:
            await self.store.runs.set_state(run.namespace, run.run_id, None, time.time() if now is None else now,
                                            claimed_until=0)
        if deferred:  # one line a tick, however many wait
            log.warning("%d restart(s) deferred: at [supervisor] max_restarts_per_minute (%d) or "
                        "max_hook_processes", len(deferred), self.settings.supervisor.max_restarts_per_minute)
        return done

    async def _handle_batch(self, batch: list[Run], now: float) -> list[tuple[Run, str]]:
        """Each run of ``batch`` handled, HANDLED_AT_ONCE at a time: what was done with each."""
        at_once = asyncio.Semaphore(HANDLED_AT_ONCE)

        async def handle(run: Run) -> str | None:
            async with at_once:
                return await self._handle_silent(run, now)
        handled = []
        for run, action in zip(batch, await asyncio.gather(*map(handle, batch), return_exceptions=True)):
            if isinstance(action, BaseException):  # one bad run must not stop the others
                log.error("run %s/%s not handled: %r", run.namespace, run.run_id, action,
                          exc_info=None if isinstance(action, StoreUnavailable) else action)
            elif action:
                handled.append((run, action))
        return handled

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
                                            next_restart_at=now + delay,
                                            claimed_until=0)  # the backoff alone says when it is due
            return "backoff"
        if not self._may_restart(now):
            return DEFERRED  # left silent: a later tick with room restarts it; nothing is counted
        self._starting += 1
        try:
            new = await self.runs.restart(run, reason=RESTART, expected_epoch=run.epoch, now=now,
                                          window_s=window,
                                          ended=await with_log_tail(run, supervisor_ending(run, now)))
        finally:
            self._starting -= 1
        if new is None:
            return None  # another supervisor restarted it, or it ended meanwhile
        self._restarted.append(now)
        if self.metrics is not None:
            self.metrics.restarts.inc()
        return "restart"

    def _may_restart(self, now: float) -> bool:
        """Within this supervisor's bounds: restarts per minute, hook processes at once."""
        return self._room(now) > 0 and self.runs.launcher.has_room(self._starting)

    def _room(self, now: float) -> int:
        """Restarts this supervisor may still start within the minute up to ``now``."""
        while self._restarted and self._restarted[0] <= now - 60:
            self._restarted.popleft()
        return self.settings.supervisor.max_restarts_per_minute - len(self._restarted) - self._starting

    def backoff(self, restarts: int) -> float:
        """Extra wait before the next restart, given the restarts already in the window."""
        if restarts == 0:
            return 0.0
        runs = self.settings.runs
        return min(runs.backoff_base_s * 2 ** (restarts - 1), runs.backoff_max_s)

    async def _bury(self, run: Run, now: float, why: str) -> str | None:
        # Fenced by the epoch found silent: an attempt started meanwhile is not buried.
        ending = await with_log_tail(run, {**supervisor_ending(run, now), "dead": why})
        ended = await self.store.runs.end(run.namespace, run.run_id, RunState.DEAD, now, epoch=run.epoch,
                                          ended=ending)
        # end is idempotent: the run carries our ``now`` only if this call ended it,
        # so among several supervisors exactly one fires on_dead.
        if ended is None or ended.state != RunState.DEAD or ended.ended_at != now:
            return None
        log.warning("run %s/%s is dead: %s", run.namespace, run.run_id, why)
        await self.store.runs.set_state(run.namespace, run.run_id, None, now,
                                        {"event": "why-dead", "epoch": run.epoch, "detail": why})
        on_dead = self.settings.runs.on_dead
        # Only for a run someone authorised to start processes: a hook armed, or a namespace
        # on_dead allows. Runs that traffic made up die quietly (they cannot spawn anything).
        if on_dead and (run.hook or self.settings.may_arm(on_dead, run.namespace)):
            await self.runs.launcher.fire(on_dead, RunState.DEAD, ended)
        return "dead"


def recent_restarts(restart_times: list[float], now: float, window: float) -> list[float]:
    """The restart times within ``window`` seconds before ``now``."""
    return [at for at in restart_times if at > now - window]
