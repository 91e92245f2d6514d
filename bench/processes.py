"""The processes the benchmark starts, the stores it makes, and the promise to clean up.

Every server runs in a session (and process group) of its own, so that the group can
be signalled as a whole: ``idemproxy serve --workers 2`` has children, and a terminal's
Ctrl-C reaches only the benchmark, which then stops each group it started, by its id,
SIGTERM first and SIGKILL after a grace period. Everything listens on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import importlib.util
import ipaddress
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

import nginx

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
STOP_GRACE_S = 10.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# urllib honours http_proxy from the environment; the benchmark talks to loopback only.
HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class BenchError(RuntimeError):
    """Something the benchmark needs did not start or did not behave."""


def stop_on_signals() -> None:
    """SIGTERM unwinds through every `finally`, so every process a bench started is stopped;
    Ctrl-C does too, even when a shell started the bench with SIGINT ignored."""
    def terminate(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def git_head() -> str | None:
    """The checkout's short commit, for the record of a run."""
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_facts(loadgen: str, duration_s: float) -> dict:
    """What every bench run's record starts with: when, where, on what code, how busy."""
    return {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "loadgen": loadgen, "duration_s": duration_s,
            "cpus": os.cpu_count(), "python": platform.python_version(), "git": git_head(),
            "loadavg_start": os.getloadavg()}


def py_spy() -> str | None:
    """py-spy, on the PATH or beside this Python (pip installs it into the venv's bin)."""
    return shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None,
         timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    """One request, for probes and counters (never for load)."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with HTTP.open(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers.items()), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers.items()), exc.read()


@dataclass
class Server:
    name: str
    port: int
    popen: subprocess.Popen
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


class Processes:
    """Starts servers and always stops them: use as a context manager."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self._servers: list[Server] = []
        self._env = {k: v for k, v in os.environ.items() if not k.startswith("IDEMPROXY_")}

    def __enter__(self) -> "Processes":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    def start(self, name: str, argv: list[str], port: int, ready: Callable[[Server], bool],
              timeout: float = 30.0, env: dict[str, str] | None = None) -> Server:
        log = self.workdir / f"{name}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen(argv, stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                                     env={**self._env, **(env or {})}, cwd=self.workdir, start_new_session=True)
        server = Server(name, port, popen, log)
        self._servers.append(server)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if popen.poll() is not None:
                raise BenchError(f"{name} exited with {popen.returncode}:\n{server.log_tail()}")
            try:
                if ready(server):
                    return server
            except OSError:
                pass
            time.sleep(0.1)
        raise BenchError(f"{name} did not become ready in {timeout:.0f}s:\n{server.log_tail()}")

    def stop(self, server: Server) -> None:
        """SIGTERM to the server's process group, then SIGKILL to whatever is left of it."""
        if server in self._servers:
            self._servers.remove(server)
        _signal_group(server.popen.pid, signal.SIGTERM)
        try:
            server.popen.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(server.popen.pid, signal.SIGKILL)  # workers the parent left behind
        if server.popen.poll() is None:
            server.popen.wait()

    def stop_all(self) -> None:
        for server in reversed(list(self._servers)):
            self.stop(server)

    # -- the three kinds of server --------------------------------------------------------

    def provider(self) -> Server:
        port = free_port()
        return self.start("provider", [sys.executable, str(BENCH / "provider.py"), "--port", str(port)],
                          port, lambda s: http("GET", s.url + "/_calls", timeout=1)[0] == 200)

    def nginx(self) -> Server:
        """The fast provider (bench/nginx.py): a fixed chat completion, answered from memory."""
        port = free_port()
        try:
            argv = nginx.argv(nginx.write_config(port, self.workdir))
        except FileNotFoundError as exc:
            raise BenchError(str(exc)) from None
        return self.start("nginx", argv, port, lambda s: http("GET", s.url + "/_calls", timeout=1)[0] == 200)

    def baseline(self, upstream: str, processes: int = 1) -> Server:
        port = free_port()
        server = self.start(f"baseline-p{processes}", [
            sys.executable, str(BENCH / "baseline.py"), "--port", str(port), "--upstream", upstream,
            "--processes", str(processes)], port, _listening)
        if processes > 1:
            time.sleep(1.0)  # one process answered; give the others their start
        return server

    def redis(self, *config: str) -> Server:
        """A private redis-server (no persistence, as the shared one): its memory is ours alone.
        ``config``: more of its options, as ``"name value"``."""
        port = free_port()
        options = [word for option in config for word in ("--" + option.split()[0], *option.split()[1:])]
        return self.start("redis", ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                    "--appendonly", "no", "--dir", str(self.workdir), *options],
                          port, _listening)

    def mcp_tools(self) -> Server:
        """examples/mcp_tool_server.py (the official MCP SDK's server), answering JSON."""
        port = free_port()
        return self.start("mcp-tools", [sys.executable, str(REPO / "examples" / "mcp_tool_server.py"),
                                        "--port", str(port), "--json"],
                          port, lambda s: http("GET", s.url + "/calls", timeout=1)[0] == 200)

    def idemproxy(self, name: str, upstream: str, store_url: str, workers: int,
                  mcp: str | None = None, env: dict[str, str] | None = None, wrap: list[str] = ()) -> Server:
        """``env``: settings as ``IDEMPROXY_*`` variables, over the generated configuration;
        ``wrap``: a command the proxy runs under (valgrind, for bench/instructions.py)."""
        port = free_port()
        config = self.workdir / f"{name}.toml"
        config.write_text(
            "[server]\n"
            f'host = "127.0.0.1"\nport = {port}\nworkers = {workers}\naccess_log = false\n\n'
            f'[store]\nurl = "{store_url}"\n\n'
            f'[upstreams.openai]\nurl = "{upstream}"\n\n'
            + (f'[upstreams.mcp]\nurl = "{mcp}"\nkind = "mcp"\n\n' if mcp else "")
            + "[supervisor]\nenabled = false\n")
        argv = [*wrap, sys.executable, "-m", "idemproxy.proxy.cli", "--log-level", "WARNING", "serve",
                "--config", str(config), "--no-supervisor"]
        server = self.start(name, argv, port, lambda s: http("GET", s.url + "/readyz", timeout=1)[0] == 200,
                            timeout=600 if wrap else 60, env=env)
        if workers > 1:
            time.sleep(1.0)  # /readyz answered from one worker; give the others their start
        return server


def cpu_seconds(server: Server) -> float | None:
    """CPU time (user + system) used so far by the server's process group; None off Linux.

    On a shared two-core machine, requests/s depends on who else runs; CPU time per
    request of the process under test does much less, so the benchmark reports both.
    """
    total, found = 0.0, False
    for _, pgrp, cpu in _processes():
        if pgrp == server.popen.pid:
            total += cpu
            found = True
    return total if found else None


def group_members(server: Server) -> tuple[int, int]:
    """How many processes, and threads in all, the server's process group has now."""
    processes = threads = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()  # [2] the pgrp, [17] num_threads
        except OSError:
            continue  # exited meanwhile
        if int(fields[2]) == server.popen.pid:
            processes += 1
            threads += int(fields[17])
    return processes, threads


def store_server_seconds() -> float:
    """CPU time used so far by the PostgreSQL and Redis servers (by process name)."""
    return sum(cpu for comm, _, cpu in _processes() if comm in STORE_SERVERS)


STORE_SERVERS = frozenset({"postgres", "redis-server"})


def _processes():
    """(command name, process group, CPU seconds) of every process we may read."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # exited meanwhile
        comm = text[text.find("(") + 1:text.rfind(")")]
        fields = text.rpartition(")")[2].split()  # fields[0] is the state, [2] the pgrp
        yield comm, int(fields[2]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def machine_busy_seconds() -> float | None:
    """CPU time all cores spent busy since boot (everyone's: ours, the stores', others')."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / CLOCK_TICKS


def _listening(server: Server) -> bool:
    with socket.create_connection(("127.0.0.1", server.port), timeout=0.5):
        return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# -- stores ---------------------------------------------------------------------------------

STORE_MODULES = {"sqlite": "sqlite", "postgres": "postgres", "redis": "redis"}


def require_loopback(url: str) -> str:
    host = urlsplit(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise BenchError(f"{url}: the benchmark only talks to loopback addresses")
    return url


def check_store(kind: str, postgres: str, redis: str) -> None:
    """The store can be benchmarked: its module exists, its server answers on loopback."""
    if kind not in STORE_MODULES:
        raise BenchError(f"unknown store {kind!r} (sqlite, postgres or redis)")
    if importlib.util.find_spec(f"idemproxy.proxy.store.{STORE_MODULES[kind]}") is None:
        raise BenchError(f"proxy/store/{STORE_MODULES[kind]}/ does not exist (yet)")
    if kind != "sqlite":
        _require_reachable(postgres if kind == "postgres" else redis)


def make_store(kind: str, workdir: Path, postgres: str, redis: str) -> tuple[str, Callable[[], None]]:
    """A fresh, empty store of ``kind``: its URL and how to remove it afterwards."""
    check_store(kind, postgres, redis)
    tag = uuid.uuid4().hex[:10]
    if kind == "sqlite":
        return f"sqlite:///{workdir}/bench-{tag}.db", lambda: None
    if kind == "postgres":
        schema = f"bench_{tag}"
        return _with(postgres, "schema", schema), lambda: _drop_schema(postgres, schema)
    prefix = f"bench{tag}:"
    return _with(redis, "prefix", prefix), lambda: _drop_prefix(redis, prefix)


def _with(url: str, name: str, value: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}{name}={value}"


def _require_reachable(url: str) -> None:
    parts = urlsplit(require_loopback(url))
    try:
        with socket.create_connection((parts.hostname, parts.port or 0), timeout=2):
            return
    except OSError as exc:
        raise BenchError(f"{url}: not reachable ({exc})") from None


def _drop_schema(url: str, schema: str) -> None:
    import asyncpg

    async def drop() -> None:
        conn = await asyncpg.connect(url, timeout=5)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await conn.close()
    asyncio.run(drop())


def _drop_prefix(url: str, prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        batch = []
        for key in client.scan_iter(match=prefix + "*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                client.delete(*batch)
                batch.clear()
        if batch:
            client.delete(*batch)
    finally:
        client.close()
