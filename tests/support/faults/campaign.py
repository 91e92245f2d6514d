"""A fault campaign: many agents through two proxy replicas and a supervisor on one store
server, while agents, replicas, the store server and the supervisor are SIGKILLed and
started again at random. See tests/supervisor/test_fault_campaign.py for what it proves.

``Campaign`` is an async context manager: whatever happens inside, leaving it kills every
process it started (supervisor first, so no hook spawns an agent while agents are killed).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
from aiohttp import web

import services
from config_files import write_config

from .chaos import Chaos, Schedule
from .cluster import Agents, Service, StoreServer, idemproxy
from .ledger import Ledger
from .verdict import Report, check_ledger, check_runs, count_calls, crashes, read_events, reask_all

ADMIN_TOKEN = "campaign-admin-token"
REPLICAS = 2


@dataclass(frozen=True)
class Plan:
    backend: str  # "postgres", "redis" or "redis-cluster"
    seed: int
    fault_seconds: float  # how long faults are injected and new runs started
    agents: int = 6  # runs in flight at once
    steps: int = 8  # logical steps per run: a model call and a tool call each
    think_s: float = 0.15  # an agent's pause before each step, on average
    drain_s: float = 60.0  # after the last fault, the bound for every run to complete
    timeout_s: float = 3.0  # a run silent this long is restarted by the supervisor
    max_restarts: int = 50
    fault_every_s: float = 1.2  # mean time between two faults


def sections(plan: Plan, ledger: str, store: StoreServer, proxies: list[str], agent: list[str], folder: Path,
             deadline: float) -> dict[str, dict]:
    """The configuration every proxy replica and the supervisor share."""
    return {
        "server": {"host": "127.0.0.1", "port": 0, "in_flight_wait": "5s", "access_log": False},
        # a short lease: a killed proxy's claims lapse within seconds, not a minute
        "store": {"url": store.url, "timeout": "2s", "lease": "3s", **store.settings},
        "upstreams.openai": {"url": ledger, "on_ambiguous": "retry", "read_timeout": "10s"},
        # the tool honours the key the proxy forwards: an ambiguous call can be sent again
        "upstreams.tools": {"url": ledger + "/tools", "kind": "tool", "on_ambiguous": "retry",
                            "idempotency_header": "Idempotency-Key", "read_timeout": "10s"},
        "runs": {"timeout_s": plan.timeout_s, "grace_s": 2.0, "max_restarts": plan.max_restarts,
                 "restart_window_s": 600, "backoff_base_s": 0.2, "backoff_max_s": 1.0},
        # one namespace of runs for the whole campaign, whose hook its runs may arm
        # (docs/security.md, "Who may do what")
        "tenants": {"runs": "shared"},
        "hooks.agent": {"command": agent, "log_dir": str(folder / "hook-logs"), "allow_tenants": ["default"],
                        "env": agent_env(plan, proxies, deadline)},
        "supervisor": {"enabled": False, "interval_s": 0.25, "proxy_url": proxies[0]},
        "admin": {"token": ADMIN_TOKEN},
    }


def agent_env(plan: Plan, proxies: list[str], deadline: float) -> dict[str, str]:
    return {"CAMPAIGN_PROXIES": ",".join(proxies), "CAMPAIGN_STEPS": str(plan.steps),
            "CAMPAIGN_THINK_S": str(plan.think_s), "CAMPAIGN_DEADLINE": str(deadline)}


class Campaign:
    def __init__(self, plan: Plan, folder: Path):
        self.plan = plan
        self.folder = folder
        self.ledger = Ledger()
        self.store: StoreServer | None = None
        self.proxies: list[Service] = []
        self.supervisor: Service | None = None
        self.agents: Agents | None = None
        self.registered: set[str] = set()
        self._chaos: Chaos | None = None
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    # -- up and down ----------------------------------------------------------------------

    async def __aenter__(self) -> "Campaign":
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15))
        return self

    async def __aexit__(self, *exc) -> None:
        if self._chaos is not None:
            await self._chaos.quiesce()
        await asyncio.to_thread(self._kill_everything)
        await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    def _kill_everything(self) -> None:
        for service in [self.supervisor, *self.proxies]:
            if service is not None:
                service.kill()
        if self.agents is not None:
            self.agents.kill_all()
        if self.store is not None:
            self.store.destroy()

    async def _start(self) -> None:
        port = services.free_port()
        self._runner = web.AppRunner(self.ledger.app(), access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.store = await asyncio.to_thread(StoreServer, self.plan.backend)
        await asyncio.to_thread(self.store.start)

        ports = [services.free_port() for _ in range(REPLICAS)]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        deadline = time.time() + self.plan.fault_seconds + self.plan.drain_s + 60
        self.agents = Agents(self.folder, {**_inherited(), **agent_env(self.plan, urls, deadline)})
        config = write_config(self.folder / "campaign.toml", sections(
            self.plan, f"http://127.0.0.1:{port}", self.store, urls, self.agents.argv, self.folder, deadline))
        self.proxies = [idemproxy(f"proxy-{i}", "serve", config, p) for i, p in enumerate(ports)]
        await asyncio.gather(*(asyncio.to_thread(p.start) for p in self.proxies))
        self.supervisor = idemproxy("supervisor", "supervise", config)
        await asyncio.to_thread(self.supervisor.start)

    # -- the campaign ---------------------------------------------------------------------

    async def run(self) -> Report:
        began = time.monotonic()
        report = Report(self.plan.backend, self.plan.seed, self.plan.fault_seconds)
        await self._start()
        chaos = self._chaos = Chaos(Schedule(self.plan.seed, self.plan.fault_every_s), self.store, self.proxies,
                                    self.supervisor, self.agents)
        until = time.monotonic() + self.plan.fault_seconds
        async with asyncio.TaskGroup() as both:  # one fails: the other is cancelled
            both.create_task(chaos.inject_until(until))
            both.create_task(self._launch_until(until))
        await chaos.settle()  # every service is back up; agents killed last are restarted by the supervisor
        report.faults, report.fault_log = chaos.by_kind(), [asdict(f) for f in chaos.injected]
        report.failed_starts = {s.name: s.failed_starts for s in (*self.proxies, self.supervisor)}
        runs = await self._drain(time.monotonic() + self.plan.drain_s)
        await self._verify(report, runs)
        report.seconds = time.monotonic() - began
        return report

    async def _launch_until(self, until: float) -> None:
        """Keep ``plan.agents`` runs in flight: register each run (retrying, as a scheduler
        would), then start its first attempt."""
        kinds = itertools.cycle("xd")  # explicit keys, derived keys
        active: list[str] = []
        for n in itertools.count(1):
            while len(active) >= self.plan.agents:
                await asyncio.sleep(0.1)
                active = [r for r in active if not self.agents.done(r)]
            if time.monotonic() >= until:
                return
            run = f"{next(kinds)}-{n:03d}"
            if await self._register(run, until):
                self.registered.add(run)
                await asyncio.to_thread(self.agents.launch, run)
                active.append(run)

    async def _register(self, run: str, until: float) -> bool:
        body = {"timeout_s": self.plan.timeout_s, "grace_s": 2.0, "hook": "agent",
                "max_restarts": self.plan.max_restarts}
        for i in itertools.count():
            if time.monotonic() >= until:
                return False
            try:
                async with self._session.post(f"{self.proxies[i % REPLICAS].url}/runs/{run}", json=body,
                                              headers={"Authorization": f"Bearer sk-campaign-{run}"}) as r:
                    if r.status in (200, 201):
                        return True
                    if r.status != 503:
                        raise AssertionError(f"registering {run}: {r.status} {await r.text()}")
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.1)
        raise AssertionError("unreachable")

    async def _runs(self) -> list[dict] | None:
        """Every run in the store, from the admin API; None while the store is unreachable."""
        try:
            async with self._session.get(f"{self.proxies[0].url}/admin/runs?limit=10000",
                                         headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as r:
                if r.status == 503:
                    return None
                assert r.status == 200, await r.text()
                return (await r.json())["runs"]
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None

    async def _drain(self, deadline: float) -> list[dict]:
        """Until every run in the store is completed, or the deadline."""
        while True:
            runs = await self._runs()
            if runs is not None and all(r["state"] == "completed" for r in runs):
                return runs
            if time.monotonic() > deadline:
                assert runs is not None, "the store was still unreachable when the drain ended"
                return runs
            await asyncio.sleep(0.5)

    async def _verify(self, report: Report, runs: list[dict]) -> None:
        completed = check_runs(report, self.registered, runs)
        answers = count_calls(report, read_events(self.folder))
        report.anomalies += crashes(self.folder)
        check_ledger(report, self.ledger.deliveries, answers, completed, self.plan.steps)
        await reask_all(report, self._session, [p.url for p in self.proxies], answers,
                        lambda: len(self.ledger.deliveries))


def _inherited() -> dict[str, str]:
    """What a first attempt inherits: our environment minus our settings, as a hook's
    command inherits the supervisor's."""
    return {k: v for k, v in os.environ.items() if not k.startswith("IDEMPROXY_")}
