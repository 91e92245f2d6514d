"""The fault campaign's processes: a store server (or cluster), proxy replicas, a supervisor,
agents.

Each runs in a process group (a session) of its own, is killed with SIGKILL on the whole
group, and can be started again on the same port and data. ``kill_everything`` at the end of
a campaign, pass or fail, leaves nothing behind: agents started by the supervisor's hook are
found by the pid files they write, and checked by their command line before they are killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import services
from redis_cluster import RedisCluster
from services import PrivatePostgres, PrivateRedis

AGENT = Path(__file__).resolve().parent.parent / "agents" / "campaign_agent.py"
# Longer than a proxy's own start while its store is down: it tries to open the store 8 times,
# 0.5 s apart doubling to 10 s (~36 s), and only then exits to be started again. With 30 s, a
# proxy whose tries all fell in the store's outages (killed again and again) was taken for hung.
START_TIMEOUT_S = 60.0
START_TRIES = 5


def _gone(pid: int) -> bool:
    """Whether the process no longer exists (a zombie still does, to kill(pid, 0))."""
    return not os.path.exists(f"/proc/{pid}")


def _wait_gone(pids: list[int], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(_gone(p) for p in pids):
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} still exist {timeout}s after SIGKILL")
        time.sleep(0.02)


class Service:
    """One of our commands in its own session, ready when its port answers (or, without a
    port, when its log says ``ready_line``)."""

    def __init__(self, name: str, argv: list[str], log: Path, port: int | None = None,
                 ready_line: str | None = None):
        self.name, self.argv, self.log, self.port, self.ready_line = name, argv, log, port, ready_line
        self.proc: subprocess.Popen | None = None
        self.failed_starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def up(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Start it, and start it again if it exits while starting, as an orchestrator
        restarts a container that fails (``failed_starts`` counts those)."""
        for _ in range(START_TRIES):
            if self._start_once():
                return
            self.failed_starts += 1
        raise RuntimeError(f"{self.name} failed to start {START_TRIES} times: {self.log.read_text()[-3000:]}")

    def _start_once(self) -> bool:
        offset = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._ready(offset):
            if self.proc.poll() is not None:
                self.kill()
                return False
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.name} did not start in {START_TIMEOUT_S:g}s: "
                                   f"{self.log.read_text()[-3000:]}")
            time.sleep(0.05)
        return True

    def _ready(self, offset: int) -> bool:
        if self.port is not None:
            return services.reachable(self.url, 0.2)
        with open(self.log, "rb") as f:
            f.seek(offset)
            return self.ready_line.encode() in f.read()

    def kill(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None


def idemproxy(name: str, command: str, config: Path, port: int | None = None) -> Service:
    argv = [sys.executable, "-m", "idemproxy.proxy.cli", command, "--config", str(config)]
    if port is not None:
        argv += ["--port", str(port)]
    return Service(name, argv, config.parent / f"{name}.log", port,
                   ready_line=None if port else "supervisor watching")


class StoreServer:
    """A private PostgreSQL or Redis (``appendfsync always``: every acknowledged write is on
    disk), killed with SIGKILL like a crashed host and started again on its data; or a Redis
    Cluster (``redis-cluster``), whose fault is one of its masters killed (each in turn: the
    campaign's shards are on all of them), its replica promoted, and the killed node started
    again as that one's replica. ``settings``
    are the ``[store]`` options the proxies need for it."""

    def __init__(self, backend: str):
        self.backend = backend
        self.settings: dict[str, object] = {}
        if backend == "postgres":
            self.server = PrivatePostgres()
            self.url = f"{self.server.url}?schema=campaign"
        elif backend == "redis":
            self.server = PrivateRedis(appendonly=True, appendfsync="always")
            self.url = f"{self.server.url}?prefix=campaign:"
        elif backend == "redis-cluster":
            self.server = RedisCluster(appendonly=True, appendfsync="always")
            self.url = f"{self.server.url}?prefix=campaign:"
            # a master killed before its replica had a write would lose it: acknowledge a
            # claim or a record only once a replica has it
            self.settings["redis_wait_replicas"] = 1
        else:
            raise ValueError(f"the campaign kills a store server: postgres, redis or redis-cluster, not {backend}")
        self.up = False
        self._dead_master: int | None = None
        self._kills = 0

    def start(self) -> None:
        if self._dead_master is None:
            self.server.start()
        else:  # the replica takes over while the killed master is down, then it rejoins
            self.server.wait_promoted(self._dead_master)
            self.server.restart(self._dead_master)
            self._dead_master = None
        self.up = True

    def kill(self) -> None:
        self.up = False
        if self.backend == "redis-cluster":
            masters = self.server.masters()
            self._dead_master = masters[self._kills % len(masters)]
            self._kills += 1
            self.server.kill(self._dead_master)
            return
        if self.backend == "redis":
            self.server.stop()  # SIGKILL, and reaped
            return
        with open(os.path.join(self.server.data, "postmaster.pid")) as f:
            main = int(f.readline())
        os.kill(main, signal.SIGSTOP)  # so it forks no new backend while we collect them
        doomed = [main, *services.children(main)]
        for pid in doomed:
            os.kill(pid, signal.SIGKILL)
        # PostgreSQL refuses to start while the pid in postmaster.pid exists, zombie or not
        _wait_gone(doomed)

    def destroy(self) -> None:
        self.server.destroy()


class Agents:
    """Agent processes: the first attempts we start, and every process the hook started,
    found by the pid files the agent writes first thing."""

    def __init__(self, folder: Path, env: dict[str, str]):
        self.folder = folder
        self.env = env
        self.started: list[subprocess.Popen] = []
        # launch and kill run in worker threads at once: a Popen dropped from the list
        # while its process runs would never be waited for
        self._lock = threading.Lock()
        for sub in ("pids", "events", "done", "agent-logs"):
            (folder / sub).mkdir(exist_ok=True)

    @property
    def argv(self) -> list[str]:
        return [sys.executable, str(AGENT), "--dir", str(self.folder)]

    def launch(self, run_id: str) -> None:
        """The run's first attempt, as a person or a job scheduler would start it."""
        with open(self.folder / "agent-logs" / f"{run_id}.0.log", "ab") as out, self._lock:
            self.started.append(subprocess.Popen(
                self.argv, stdout=out, stderr=out, stdin=subprocess.DEVNULL, start_new_session=True,
                env={**self.env, "IDEM_RUN_ID": run_id, "IDEM_EPOCH": "0"}))
        self.reap()

    def done(self, run_id: str) -> bool:
        return (self.folder / "done" / run_id).exists()

    def live(self) -> list[int]:
        """Pids of our agents that are running now, oldest first."""
        found = []
        for entry in (self.folder / "pids").iterdir():
            pid = int(entry.name)
            if self._ours(pid):
                found.append(pid)
        return sorted(found)

    def _ours(self, pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            return False
        return state != b"Z" and str(AGENT).encode() in argv and str(self.folder).encode() in argv

    def kill(self, pid: int) -> bool:
        """SIGKILL the agent's process group; False if it was gone already."""
        if not self._ours(pid):
            return False
        try:
            os.killpg(pid, signal.SIGKILL) if os.getpgid(pid) == pid else os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        self.reap()
        return True

    def reap(self) -> None:
        with self._lock:
            self.started = [p for p in self.started if p.poll() is None]

    def kill_all(self) -> None:
        (self.folder / "stop").touch()  # an agent about to start gives up by itself
        for _ in range(3):  # a hook may have spawned one while we looked
            for pid in self.live():
                self.kill(pid)
            time.sleep(0.2)
        with self._lock:
            for proc in self.started:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            self.started = []

