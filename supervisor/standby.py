"""Standbys: processes of a command hook started ahead, imported and waiting for a run.

A restarted agent spends most of its first second importing (the openai SDK, httpx...)
before it sends a request. ``[hooks.NAME] standby = N`` keeps N processes of the hook's
argv started ahead, as a worker pool does (Temporal's workers are long-lived processes):
when the hook fires, an idle standby is told which run it is, and the imports are already
paid.

The channel is the standby's stdin: one end of a Unix socket pair, private to the child
(nothing else holds it; it is not in its environment). The standby's environment is the one
a spawned hook gets without the facts of a call (no ``IDEM_RUN_ID``...), plus
``IDEM_STANDBY=1``. The client library (``idemproxy_client.wait_for_assignment``, called by
``Run()``) writes ``ready`` once its imports are done, then reads one JSON line: the
``IDEM_*`` facts a spawned hook would find in its environment, and nothing else. It puts
them in ``os.environ``, points its stdin at /dev/null and goes on as a spawned agent.

Only a standby that said ``ready`` is handed a run: a process that does not wait (an agent
not on the client library) would ignore the assignment, so it never gets one. One that
stays silent past ``READY_TIMEOUT_S`` is terminated and the hook's standbys are turned off
(every restart spawns, as without them); so are they after ``MAX_UNREADY`` in a row that
end, or cannot start, before saying ``ready`` (a broken argv, an agent that exits). A
standby that dies idle is replaced after a backoff that grows with each death in a row. Stopping the pool
terminates idle standbys (its own process group each); an assigned one is an agent, left
running as any spawned agent is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import orjson

from ..proxy.config import HookSettings
from .reaper import describe, exit_facts, exited
from .spawn import SpawnError, spawn_detached

log = logging.getLogger("idemproxy.supervisor")

STANDBY_ENV = "IDEM_STANDBY"  # set to "1" in a standby's environment; the client library waits
READY = b"ready\n"  # what a waiting standby says on its channel
READY_TIMEOUT_S = 30.0  # a standby silent this long does not wait for assignments
BACKOFF_S = 0.5  # before replacing the first standby of a series that died idle; doubles
BACKOFF_MAX_S = 30.0
HEALTHY_S = 10.0  # a standby idle this long ends a series of deaths
STOP_GRACE_S = 2.0  # after SIGTERM, before SIGKILL, when the pool stops
REPLACE_AFTER_S = 3.0  # from a standby taken to its replacement started
MAX_UNREADY = 5  # standbys in a row that end before saying ready: the hook's standbys are turned off


@dataclass(eq=False)
class Standby:
    """One process started ahead: its pid, our end of its channel, its log."""
    pid: int
    channel: socket.socket
    log_path: Path
    started_at: float
    ready: bool = False
    # its wait status once it exits (None when someone else reaped it); shielded by watchers
    ended: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class StandbyPool:
    """Keeps ``hook.standby`` idle processes of one command hook (one pool per supervisor)."""

    def __init__(self, hook: HookSettings, environment: Mapping[str, str]):
        self.hook = hook
        self._env = {**environment, STANDBY_ENV: "1"}
        self._idle: list[Standby] = []
        self._lives: set[asyncio.Task] = set()  # one per standby started, until it exits
        self._wanted = asyncio.Event()  # a standby was taken or died: start another
        self._keeper: asyncio.Task | None = None
        self._deaths = 0  # idle deaths in a row
        self._unready = 0  # standbys in a row that ended (or never started) before saying ready
        self._off = False

    def start(self) -> None:
        self._keeper = asyncio.create_task(self._keep(), name=f"standbys-{self.hook.name}")

    @property
    def waiting(self) -> int:
        """Idle standbys that said they wait: how many restarts could be handed one now."""
        return sum(s.ready and not s.ended.done() for s in self._idle)

    def take(self) -> Standby | None:
        """An idle standby that said it waits, no longer idle (another is started); else None."""
        for standby in self._idle:
            if standby.ready and not standby.ended.done():
                self._idle.remove(standby)
                # not at once: the replacement's imports would take the CPU the new attempt's
                # replay needs (in one measurement on two cores, a replay of 2.7 s instead of 1.2 s)
                asyncio.get_running_loop().call_later(REPLACE_AFTER_S, self._wanted.set)
                return standby
        return None

    async def assign(self, standby: Standby, facts: Mapping[str, str], log_path: Path) -> Path | None:
        """Tell ``standby`` its run (``facts``); its log moved to ``log_path`` where free: the
        log it writes to from now on, or None when the standby can no longer be told."""
        try:
            await asyncio.get_running_loop().sock_sendall(standby.channel, orjson.dumps(dict(facts)) + b"\n")
        except OSError as exc:  # it died meanwhile: its watcher replaces it
            log.warning("hook %s: standby pid %d could not be assigned: %s", self.hook.name, standby.pid, exc)
            return None
        finally:
            standby.channel.close()  # one assignment: the standby reads to the newline, then lets go
        self._deaths = 0
        standby.log_path = _moved(standby.log_path, log_path)
        return standby.log_path

    async def stop(self) -> None:
        """Stop starting standbys and terminate the idle ones (assigned ones are agents, and
        are left running)."""
        if self._keeper is not None:
            self._keeper.cancel()
            await asyncio.gather(self._keeper, return_exceptions=True)
        idle, self._idle = self._idle, []
        for standby in idle:
            _signal(standby.pid, signal.SIGTERM)
        if idle:
            await asyncio.wait([asyncio.shield(s.ended) for s in idle], timeout=STOP_GRACE_S)
            for standby in idle:
                if not standby.ended.done():
                    _signal(standby.pid, signal.SIGKILL)
            await asyncio.wait([asyncio.shield(s.ended) for s in idle], timeout=STOP_GRACE_S)
        for standby in idle:
            standby.channel.close()
            with contextlib.suppress(OSError):
                if standby.log_path.stat().st_size == 0:  # nothing to read: no file to clutter the dir
                    standby.log_path.unlink()

    async def aclose(self) -> None:
        """Stop, and stop watching assigned standbys (the hooks' watchers have let go)."""
        await self.stop()
        for task in self._lives:
            task.cancel()
        await asyncio.gather(*self._lives, return_exceptions=True)

    # -- keeping N idle -------------------------------------------------------------------

    async def _keep(self) -> None:
        while not self._off:
            while len(self._idle) < self.hook.standby and not self._off:
                if self._deaths:
                    await asyncio.sleep(min(BACKOFF_S * 2 ** (self._deaths - 1), BACKOFF_MAX_S))
                self._start_one()
            self._wanted.clear()
            await self._wanted.wait()

    def _start_one(self) -> None:
        log_path = Path(self.hook.log_dir) / f"standby.{self.hook.name}.{time.time_ns()}.log"
        try:
            ours, theirs = socket.socketpair()
        except OSError as exc:  # out of descriptors: as a failed start, backed off
            self._not_started(f"no channel: {exc}")
            return
        ours.setblocking(False)
        try:
            pid = spawn_detached(self.hook.command, self._env, log_path, stdin=theirs.fileno())
        except SpawnError as exc:
            ours.close()
            self._not_started(str(exc))
            return
        finally:
            theirs.close()
        named = log_path.with_name(f"standby.{self.hook.name}.{pid}.log")
        with contextlib.suppress(OSError):  # its pid in its name, for the operator; the open file follows
            os.rename(log_path, named)
            log_path = named
        standby = Standby(pid, ours, log_path, time.time())
        self._idle.append(standby)
        task = asyncio.create_task(self._life(standby), name=f"standby-{pid}")
        self._lives.add(task)
        task.add_done_callback(self._lives.discard)
        log.info("hook %s: standby pid %d started, log %s", self.hook.name, pid, log_path)

    async def _life(self, standby: Standby) -> None:
        """Hear the standby say it waits, then wait for its exit; a death while idle is
        replaced."""
        ended = asyncio.ensure_future(exited(standby.pid))
        try:
            said = asyncio.ensure_future(_read_line(standby.channel))
            done, _ = await asyncio.wait({said, ended}, timeout=READY_TIMEOUT_S,
                                         return_when=asyncio.FIRST_COMPLETED)
            said.cancel()
            if said in done and not said.cancelled() and not said.exception() and said.result() == READY:
                standby.ready = True
                self._unready = 0
            elif not done and standby in self._idle:
                self._turn_off(f"pid {standby.pid} did not say it waits for a run within "
                               f"{READY_TIMEOUT_S:g}s (log {standby.log_path})", standby)
            status = await ended
        except BaseException:
            ended.cancel()
            raise
        standby.ended.set_result(status)
        if standby in self._idle:
            self._idle.remove(standby)
            standby.channel.close()
            self._died_idle(standby, describe(exit_facts(status)))

    def _not_started(self, why: str) -> None:
        self._deaths += 1
        log.warning("hook %s: standby not started: %s", self.hook.name, why)
        self._count_unready(why)

    def _died_idle(self, standby: Standby, how: str) -> None:
        healthy = standby.ready and time.time() - standby.started_at >= HEALTHY_S
        self._deaths = 1 if healthy else self._deaths + 1
        log.warning("hook %s: idle standby pid %d %s%s; replacing it", self.hook.name, standby.pid, how,
                    "" if standby.ready else " before it said it waits for a run (log " + str(standby.log_path) + ")")
        if not standby.ready:
            self._count_unready(f"the last, pid {standby.pid}, {how}; log {standby.log_path}")
        self._wanted.set()

    def _count_unready(self, last: str) -> None:
        self._unready += 1
        if self._unready >= MAX_UNREADY:
            self._turn_off(f"{self._unready} standbys in a row ended before they said they wait for a run ({last})")

    def _turn_off(self, why: str, standby: Standby | None = None) -> None:
        """Standbys are not working for this hook: no more of them (restarts spawn the command)."""
        log.error("hook %s: standbys turned off: %s. An agent not on the idemproxy-client library cannot "
                  "be a standby; restarts spawn the command.", self.hook.name, why)
        self._off = True
        self._wanted.set()
        if standby is None:
            return
        self._idle.remove(standby)
        standby.channel.close()
        _signal(standby.pid, signal.SIGTERM)
        asyncio.get_running_loop().call_later(
            STOP_GRACE_S, lambda: standby.ended.done() or _signal(standby.pid, signal.SIGKILL))


async def _read_line(channel: socket.socket, limit: int = 64) -> bytes:
    """What the standby says, up to its first newline (or all of it at EOF)."""
    loop = asyncio.get_running_loop()
    said = b""
    while not said.endswith(b"\n") and len(said) < limit:
        chunk = await loop.sock_recv(channel, limit)
        if not chunk:
            break
        said += chunk
    return said


def _moved(old: Path, new: Path) -> Path:
    """Give the standby's log the attempt's name, unless a file has it (then it stays)."""
    try:
        os.link(old, new)  # unlike rename, never replaces an existing file
    except OSError:
        return old
    with contextlib.suppress(OSError):
        os.unlink(old)
    return new


def _signal(pid: int, sig: signal.Signals) -> None:
    """Signal the standby's process group (its session's, which it leads): whatever it
    started while importing is ours too."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
