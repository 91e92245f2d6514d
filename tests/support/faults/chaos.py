"""Faults at random, from a seed: SIGKILL an agent, a proxy replica, the store server or the
supervisor, and start the killed service again after a short while (an orchestrator's
restart). The seed fixes the schedule (when, what kind, which target, how long it stays
down); which agent is running at that moment depends on timing, so a rerun with the same
seed injects the same kinds of faults at the same times, not the very same outcome.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import random
import time
from dataclasses import dataclass, field

from .cluster import Agents, Service, StoreServer

log = logging.getLogger("idemproxy.faults")

KINDS = ("agent", "proxy", "store", "supervisor")


@dataclass(frozen=True)
class Schedule:
    seed: int
    every_s: float  # mean time between two faults
    weights: tuple[int, ...] = (4, 3, 2, 1)  # per kind, in the order of KINDS
    down_s: tuple[float, float] = (0.2, 2.0)  # how long a killed service stays down


@dataclass
class Fault:
    at: float  # seconds since the campaign began
    kind: str
    target: str
    down_s: float | None = None


@dataclass
class Chaos:
    schedule: Schedule
    store: StoreServer
    proxies: list[Service]
    supervisor: Service
    agents: Agents
    began: float = field(default_factory=time.monotonic)
    injected: list[Fault] = field(default_factory=list)
    _rng: random.Random = field(init=False)
    _down: set[str] = field(default_factory=set)  # killed and not yet back
    _restarts: list[asyncio.Task] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.schedule.seed)

    def by_kind(self) -> dict[str, int]:
        counts = collections.Counter(f.kind for f in self.injected)
        return {kind: counts[kind] for kind in KINDS}

    async def inject_until(self, until: float) -> None:
        """Faults at random intervals until ``until`` (time.monotonic())."""
        rng = self._rng
        first = rng.sample(KINDS, len(KINDS))  # every kind early on, then at random by weight
        for n in itertools.count():
            await asyncio.sleep(self.schedule.every_s * rng.uniform(0.5, 1.5))
            if time.monotonic() >= until:
                return
            kind = first[n] if n < len(first) else rng.choices(KINDS, self.schedule.weights)[0]
            down = rng.uniform(*self.schedule.down_s)
            pick = rng.random()  # drawn for every fault, so the schedule does not depend on timing
            if kind == "agent":
                await self._kill_agent(pick)
            elif kind == "proxy":
                up = [p for p in self.proxies if p.name not in self._down]
                if up:
                    service = up[int(pick * len(up))]
                    self._kill(kind, service.name, service.kill, service.start, down)
            elif kind == "store" and "store" not in self._down:
                self._kill(kind, "store", self.store.kill, self.store.start, down)
            elif kind == "supervisor" and "supervisor" not in self._down:
                self._kill(kind, "supervisor", self.supervisor.kill, self.supervisor.start, down)
            self._restarts = [t for t in self._restarts if not t.done() or t.exception()]

    async def _kill_agent(self, pick: float) -> None:
        live = await asyncio.to_thread(self.agents.live)
        if live:
            pid = live[int(pick * len(live))]
            if await asyncio.to_thread(self.agents.kill, pid):
                self._note("agent", f"pid {pid}")

    def _kill(self, kind: str, name: str, kill, start, down: float) -> None:
        self._down.add(name)
        self._note(kind, name, down)
        self._restarts.append(asyncio.create_task(self._outage(name, kill, start, down)))

    async def _outage(self, name: str, kill, start, down: float) -> None:
        await asyncio.to_thread(kill)
        await asyncio.sleep(down)
        await asyncio.to_thread(start)
        self._down.discard(name)

    def _note(self, kind: str, target: str, down: float | None = None) -> None:
        fault = Fault(round(time.monotonic() - self.began, 2), kind, target, down and round(down, 2))
        self.injected.append(fault)
        log.info("fault %s", fault)

    async def settle(self) -> None:
        """Wait until every killed service is back (raises what a restart raised)."""
        await asyncio.gather(*self._restarts)
        self._restarts = []

    async def quiesce(self) -> None:
        """On the way out, pass or fail: let restarts in progress end, so none starts a
        process after everything was killed."""
        await asyncio.gather(*self._restarts, return_exceptions=True)
