"""Hooks: how a run is started again, and how someone hears that a run is dead.

``command`` hooks start an argv detached: its own session (a supervisor that stops or
dies takes no agent with it), stdin from /dev/null, stdout and stderr appended to one log
file per attempt, and the exit code and signal written into the run's history when it
ends, with the last lines of that log (proxy/runs/endings.py). The command is taken for
the agent itself (``watch_exit``): when it ends while its attempt is still current and
neither completed nor failed, the attempt is marked lost and the supervisor restarts the
run at once, without waiting for ``timeout_s``. Its environment is described at
:func:`hook_environment`. With ``standby = N`` the supervisor keeps N processes of the argv
started ahead (supervisor/standby.py); a fired hook hands one of them the facts of the call
instead of spawning, and watches it the same way.
``http`` hooks POST the same facts as JSON, signed with HMAC-SHA256 over the raw body in
``Idem-Signature: sha256=<hex>``, retried with exponential backoff.

Whatever happens to a hook is recorded as an event in the run's history
(``hook-started``, ``hook-exit``, ``hook-delivered``, ``hook-failed``). A hook that fails
is a failed restart: the run stays silent and is restarted again, and counts towards
``max_restarts``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import aiohttp
import orjson

from ..proxy.config import ENV_PREFIX, HookSettings, Settings
from ..proxy.identity import TenantResolver, tenant_secret
from ..proxy.runs.endings import log_tail
from ..proxy.store import Store, StoreUnavailable
from ..proxy.store.model import Run
from .reaper import describe, exit_facts, exited
from .spawn import SpawnError, spawn_detached
from .standby import StandbyPool

log = logging.getLogger("idemproxy.supervisor")

HTTP_TIMEOUT_S = 10.0     # per delivery try
HTTP_BACKOFF_S = 0.5      # first wait between tries; doubles each time
HTTP_BACKOFF_MAX_S = 30.0
# what became of hook deliveries, recorded at once; the others wait their turn: a mass
# restart's deliveries each end in a store write, which must not take every connection of
# the store's pool. The deliveries themselves are bounded by the HTTP session's connections.
RECORDED_AT_ONCE = 32
SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")
FACTS_PREFIX = "IDEM_"  # the facts of a call (HookCall.environment), and a standby's marker
# Credentials of the supervisor's own stores and cloud account, by their well-known names.
# Agents have no use for them; provider keys (OPENAI_API_KEY, ...) are not among them,
# since agents need those. A hook's `pass_env` or `env` can still hand any of them on.
INFRA_SECRETS = frozenset({
    "PGPASSWORD", "PGPASSFILE", "PGSERVICEFILE", "DATABASE_URL", "REDIS_URL", "REDISCLI_AUTH",
    "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AZURE_CLIENT_SECRET",
    "GOOGLE_APPLICATION_CREDENTIALS"})


@dataclass(frozen=True, slots=True)
class HookCall:
    """The facts a hook is given about one attempt of a run."""
    event: str  # "restart" or "dead"
    namespace: str
    run_id: str
    epoch: int
    attempt: int  # the run's restart count after this restart
    proxy_url: str
    token: str  # the run's capability: the attempt's traffic is the run's, whatever its credential

    @property
    def run_base(self) -> str:
        return f"{self.proxy_url}/runs/{self.run_id}/epochs/{self.epoch}/cap/{self.token}"

    def environment(self) -> dict[str, str]:
        return {"IDEM_RUN_ID": self.run_id, "IDEM_EPOCH": str(self.epoch),
                "IDEM_ATTEMPT": str(self.attempt), "IDEM_PROXY_URL": self.proxy_url,
                "IDEM_RUN_BASE": self.run_base, "IDEM_NAMESPACE": self.namespace,
                "IDEM_RUN_TOKEN": self.token, "IDEM_EVENT": self.event}

    def payload(self) -> dict:
        return {"run_id": self.run_id, "epoch": self.epoch, "attempt": self.attempt,
                "proxy_url": self.proxy_url, "run_base": self.run_base,
                "namespace": self.namespace, "token": self.token, "event": self.event}


def hook_environment(hook: HookSettings, call: HookCall,
                     environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """A command hook's environment, in three layers, later ones winning:

    1. inherited from ours: with ``pass_env`` set, exactly the variables it names; else all
       but our own settings (``IDEMPROXY_*``: the admin token, the store URL) and
       :data:`INFRA_SECRETS`;
    2. the hook's ``env``;
    3. the facts of the call (``IDEM_RUN_ID``, ``IDEM_EPOCH``, ...), which nothing overrides.
    """
    return {**_without_facts(hook, environ), **call.environment()}


def standby_environment(hook: HookSettings, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """A standby's environment: a command hook's without the facts of a call (no ``IDEM_*``
    at all, so nothing it finds there can be taken for a run), which come on its channel."""
    return {k: v for k, v in _without_facts(hook, environ).items() if not k.startswith(FACTS_PREFIX)}


def _without_facts(hook: HookSettings, environ: Mapping[str, str]) -> dict[str, str]:
    if hook.pass_env is not None:
        inherited = {k: environ[k] for k in hook.pass_env if k in environ}
    else:
        inherited = {k: v for k, v in environ.items()
                     if not k.startswith(ENV_PREFIX) and k not in INFRA_SECRETS}
    return {**inherited, **{k: str(v) for k, v in hook.env.items()}}


def sign(secret: str, body: bytes) -> str:
    """The ``Idem-Signature`` value for ``body``: receivers recompute and compare it."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


class Hooks:
    """Fires hooks and records what became of them in the store (the runs service's
    :class:`~idemproxy.proxy.runs.Launcher`)."""

    def __init__(self, settings: Settings, store: Store):
        self._settings = settings
        self._tenants: TenantResolver | None = None  # mints run tokens, once the secret is read
        self._hooks = settings.hooks
        # What hooks are told, from configuration only: never from a request's Host header.
        self._proxy_url = settings.proxy_url
        self._store = store
        self._deliveries: set[asyncio.Task] = set()  # http hooks being delivered
        self._recording = asyncio.Semaphore(RECORDED_AT_ONCE)
        self._watchers: set[asyncio.Task] = set()  # started commands, until they exit
        self._session: aiohttp.ClientSession | None = None
        self._max_processes = settings.supervisor.max_hook_processes
        self._standbys: dict[str, StandbyPool] = {}  # by hook name, while a supervisor runs here

    async def fire(self, name: str | None, event: str, run: Run) -> str | None:
        """Start hook ``name`` for ``run``'s current attempt: None once started, else why
        it could not start.

        A command hook has started when its process exists; an http hook is delivered in
        the background (with retries) and its failure is recorded when it gives up.
        """
        if self._tenants is None:
            self._tenants = TenantResolver.from_settings(await tenant_secret(self._settings, self._store),
                                                         self._settings)
        call = HookCall(event, run.namespace, run.run_id, run.epoch, run.restarts, self._proxy_url,
                        self._tenants.run_token(run.namespace, run.run_id))
        hook = self._hooks.get(name) if name else None
        if hook is None:
            error = f"no hook named {name!r} is configured" if name else "the run has no hook"
        elif hook.command:
            error = await self._spawn(hook, call)
        else:
            _background(self._deliveries, self._deliver(hook, call))
            return None
        if error is not None:
            log.warning("hook %s for run %s (epoch %d) failed to start: %s", name, call.run_id,
                        call.epoch, error)
            await self._record(call, {"event": "hook-failed", "hook": name, "epoch": call.epoch,
                                      "error": error})
        return error

    def has_room(self, starting: int = 0) -> bool:
        """Whether another command hook may start: fewer than ``max_hook_processes`` of those
        this process started are still running, counting ``starting`` about to start."""
        return len(self._watchers) + starting < self._max_processes

    def keep_standbys(self) -> None:
        """Start keeping ``standby`` processes of each command hook that asks for them (the
        supervisor's loop calls this: a CLI command firing one hook has no use for them)."""
        for hook in self._hooks.values():
            if hook.command and hook.standby and hook.name not in self._standbys:
                pool = self._standbys[hook.name] = StandbyPool(hook, standby_environment(hook))
                pool.start()

    def standbys_waiting(self, name: str) -> int:
        """Idle standbys of hook ``name`` ready to take a run now."""
        pool = self._standbys.get(name)
        return pool.waiting if pool is not None else 0

    async def stop_standbys(self) -> None:
        """Terminate the idle standbys; assigned ones are agents, and keep running."""
        await asyncio.gather(*(pool.stop() for pool in self._standbys.values()))

    async def aclose(self, timeout: float = 5.0) -> None:
        """Let deliveries in flight finish (bounded); started processes keep running."""
        if self._deliveries:
            await asyncio.wait(list(self._deliveries), timeout=timeout)
        tasks = self._deliveries | self._watchers
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        pools, self._standbys = self._standbys, {}
        await asyncio.gather(*(pool.aclose() for pool in pools.values()))
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- command --------------------------------------------------------------------------

    async def _spawn(self, hook: HookSettings, call: HookCall) -> str | None:
        if not self.has_room():  # a bound whoever asks: supervisor, operator, or anything else
            return f"{self._max_processes} hook processes are running ([supervisor] max_hook_processes)"
        log_path = self._log_path(hook, call)
        if await self._hand_to_standby(hook, call, log_path):
            return None
        try:
            pid = spawn_detached(hook.command, hook_environment(hook, call), log_path)
        except SpawnError as exc:
            return str(exc)
        log.info("hook %s started for run %s epoch %d: pid %d, log %s", hook.name, call.run_id,
                 call.epoch, pid, log_path)
        await self._record(call, {"event": "hook-started", "hook": hook.name, "epoch": call.epoch,
                                  "pid": pid, "log": str(log_path)})
        _background(self._watchers, self._watch(hook, call, pid, log_path))
        return None

    async def _hand_to_standby(self, hook: HookSettings, call: HookCall, log_path: Path) -> bool:
        """Give the call to an idle standby of ``hook``, if one waits: whether one took it."""
        pool = self._standbys.get(hook.name)
        while pool is not None and (standby := pool.take()) is not None:
            logged = await pool.assign(standby, call.environment(), log_path)
            if logged is None:
                continue  # it died meanwhile; try the next one
            log.info("hook %s: standby pid %d took run %s epoch %d, log %s", hook.name, standby.pid,
                     call.run_id, call.epoch, logged)
            await self._record(call, {"event": "hook-started", "hook": hook.name, "epoch": call.epoch,
                                      "pid": standby.pid, "log": str(logged), "standby": True,
                                      "started_ahead_s": round(time.time() - standby.started_at, 3)})
            _background(self._watchers, self._watch(hook, call, standby.pid, Path(logged),
                                                    asyncio.shield(standby.ended)))
            return True
        return False

    @staticmethod
    def _log_path(hook: HookSettings, call: HookCall) -> Path:
        name = f"{SAFE_NAME.sub('_', call.namespace)}.{SAFE_NAME.sub('_', call.run_id)}.{call.epoch}"
        if call.event != "restart":
            name += f".{call.event}"
        return Path(hook.log_dir) / f"{name}.log"

    async def _watch(self, hook: HookSettings, call: HookCall, pid: int, log_path: Path,
                     ended: asyncio.Future | None = None) -> None:
        """Wait for the agent's exit (a standby's is heard by its pool: ``ended``); its exit
        goes into the history with the last lines of its log (how its attempt ended)."""
        facts = exit_facts(await (exited(pid) if ended is None else ended))
        log.info("hook %s for run %s epoch %d %s", hook.name, call.run_id, call.epoch, describe(facts))
        event = {"event": "hook-exit", "hook": hook.name, "epoch": call.epoch, "pid": pid, **facts,
                 "log": str(log_path), "log_tail": await asyncio.to_thread(log_tail, log_path)}
        if hook.watch_exit and call.event == "restart" and await self._lose(call, event):
            return
        await self._record(call, event)

    async def _lose(self, call: HookCall, event: dict) -> bool:
        """The agent's process is gone: unless its attempt completed, failed or was superseded
        first, mark it lost (with ``event``), which any supervisor restarts at once."""
        try:
            lost = await self._store.runs.lose(call.namespace, call.run_id, call.epoch, time.time(),
                                               {**event, "lost": True})
        except StoreUnavailable as exc:  # then silence (timeout_s) restarts it
            log.warning("could not mark run %s epoch %d lost: %s", call.run_id, call.epoch, exc)
            return False
        if lost:
            log.warning("run %s/%s epoch %d: its agent %s without completing the run; restarting it",
                        call.namespace, call.run_id, call.epoch, describe(event))
        return lost

    # -- http -----------------------------------------------------------------------------

    async def _deliver(self, hook: HookSettings, call: HookCall) -> None:
        payload = call.payload()
        payload["timestamp"] = int(time.time())  # inside the signed body: replays are visible
        body = orjson.dumps(payload)
        headers = {"Content-Type": "application/json", "Idem-Timestamp": str(payload["timestamp"]),
                   "User-Agent": "idemproxy-supervisor"}
        if hook.secret:
            headers["Idem-Signature"] = sign(str(hook.secret), body)
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S))
        await self._post(hook, call, body, headers)

    async def _post(self, hook: HookSettings, call: HookCall, body: bytes, headers: dict[str, str]) -> None:
        error = "not tried"
        for attempt in range(hook.retries + 1):
            if attempt:
                await asyncio.sleep(min(HTTP_BACKOFF_S * 2 ** (attempt - 1), HTTP_BACKOFF_MAX_S))
            try:
                async with self._session.post(hook.url, data=body, headers=headers) as resp:
                    await resp.read()
                    if resp.status < 300:
                        await self._record(call, {"event": "hook-delivered", "hook": hook.name,
                                                  "epoch": call.epoch, "status": resp.status,
                                                  "tries": attempt + 1})
                        return
                    error = f"answered {resp.status}"
                    if 400 <= resp.status < 500 and resp.status not in (408, 425, 429):
                        break  # the receiver refuses this request; trying again will not help
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                error = f"{type(exc).__name__}: {exc}"
            log.warning("hook %s for run %s: try %d failed: %s", hook.name, call.run_id, attempt + 1,
                        error)
        await self._record(call, {"event": "hook-failed", "hook": hook.name, "epoch": call.epoch,
                                  "error": error, "tries": attempt + 1})

    # -- bookkeeping ----------------------------------------------------------------------

    async def _record(self, call: HookCall, event: dict) -> None:
        try:
            async with self._recording:  # not the delivery: a receiver that never answers holds up no other
                await self._store.runs.set_state(call.namespace, call.run_id, None, time.time(), event)
        except StoreUnavailable as exc:
            log.warning("could not record %s for run %s: %s", event["event"], call.run_id, exc)

    async def wait_idle(self) -> None:
        """Wait until every delivery and every started process has ended and been recorded."""
        while self._deliveries or self._watchers:
            await asyncio.gather(*self._deliveries, *self._watchers, return_exceptions=True)


def _background(tasks: set[asyncio.Task], work) -> None:
    task = asyncio.create_task(work)
    tasks.add(task)
    task.add_done_callback(tasks.discard)

