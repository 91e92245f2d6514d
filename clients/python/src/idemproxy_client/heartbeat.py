"""Background heartbeats: a thread for sync code, a task for async code.

Traffic through the proxy already counts as a heartbeat. These beats cover long work
outside it (a tool run locally, a big computation) so the supervisor does not take a
busy run for a dead one. A beat that fails for a passing reason (proxy restarting) is
logged and retried at the next interval; one that says this attempt is over (superseded,
ended, gone) stops the beats for good and is reported through ``on_stop``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Awaitable, Callable

from .errors import IdemProxyError, RunEnded, RunNotFound, Superseded

log = logging.getLogger("idemproxy_client")

MIN_INTERVAL_S = 0.1
MAX_INTERVAL_S = 30.0


def interval_for(timeout_s: float) -> float:
    """A third of the run's timeout, so two beats can be lost before the run looks silent."""
    return min(max(timeout_s / 3.0, MIN_INTERVAL_S), MAX_INTERVAL_S)


def ends_beating(exc: IdemProxyError) -> bool:
    """Whether an error means this attempt is over, so beating on is pointless or harmful."""
    return isinstance(exc, (Superseded, RunEnded, RunNotFound))


async def cancelled(task: asyncio.Task[None] | None) -> None:
    """Cancel ``task`` (if any) and return once it has ended."""
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class HeartbeatThread:
    """Calls ``beat()`` every ``interval`` seconds in a daemon thread until stopped."""

    def __init__(self, beat: Callable[[], object], interval: float,
                 on_stop: Callable[[IdemProxyError], None]):
        self.interval = interval
        self._beat = beat
        self._on_stop = on_stop
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="idemproxy-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop beating; returns once a beat in progress has finished."""
        self._stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _loop(self) -> None:
        while not self._stopping.wait(self.interval):
            try:
                self._beat()
            except IdemProxyError as exc:
                if ends_beating(exc):
                    self._on_stop(exc)
                    return
                log.warning("heartbeat not delivered (next in %.1fs): %s", self.interval, exc)


class HeartbeatTask:
    """Awaits ``beat()`` every ``interval`` seconds in an asyncio task until stopped."""

    def __init__(self, beat: Callable[[], Awaitable[object]], interval: float,
                 on_stop: Callable[[IdemProxyError], None]):
        self.interval = interval
        self._beat = beat
        self._on_stop = on_stop
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="idemproxy-heartbeat")

    async def stop(self) -> None:
        """Cancel the task and wait for it to end."""
        task, self._task = self._task, None
        await cancelled(task)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self._beat()
            except IdemProxyError as exc:
                if ends_beating(exc):
                    self._on_stop(exc)
                    return
                log.warning("heartbeat not delivered (next in %.1fs): %s", self.interval, exc)
