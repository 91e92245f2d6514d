"""Real PostgreSQL and Redis servers for the tests.

The shared servers are the ones at ``IDEMPROXY_TEST_POSTGRES`` and
``IDEMPROXY_TEST_REDIS`` (by default 127.0.0.1:5432 and :6379). Where none answers,
a private one is started from the installed server binaries in a temporary folder, so
the suite also runs on a machine with the binaries but no running service. Tests that
stop a server always use a private instance on another port.
"""

from __future__ import annotations

import atexit
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from urllib.parse import urlsplit

POSTGRES_URL = os.environ.get("IDEMPROXY_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("IDEMPROXY_TEST_REDIS", "redis://127.0.0.1:6379/0")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Blackhole:
    """A listening socket whose accept backlog is full: Linux then drops the SYNs that reach
    it, so a connection attempt hangs as against a drowning or unreachable server. ``listener``
    can still be served later (``close_fillers`` first)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.listener = socket.socket()
        self.listener.bind((host, port))
        self.listener.listen(0)
        self.port = self.listener.getsockname()[1]
        self._fillers = []
        for _ in range(3):  # backlog 0 takes one; the handshakes after it are dropped
            filler = socket.socket()
            filler.setblocking(False)
            try:
                filler.connect((host, self.port))
            except BlockingIOError:
                pass
            self._fillers.append(filler)

    def close_fillers(self) -> None:
        for filler in self._fillers:
            filler.close()

    def close(self) -> None:
        self.close_fillers()
        self.listener.close()


def reachable(url: str, timeout: float = 0.5) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=timeout):
            return True
    except OSError:
        return False


def children(pid: int) -> list[int]:
    """The pids of a process's children (a PostgreSQL postmaster's backends)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if reachable(f"tcp://127.0.0.1:{port}", 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} after {timeout}s")


def _pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if found:
        return found[-1]
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"PostgreSQL's {name} is not installed (apt-get install postgresql)")
    return path


class PrivatePostgres:
    """A PostgreSQL of our own on a free port, in a temporary folder."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="idem-pg-")
        self.data = os.path.join(self.dir, "data")
        self._as_postgres = os.geteuid() == 0  # the server refuses to run as root
        if self._as_postgres:
            shutil.chown(self.dir, "postgres", "postgres")
        self._run(_pg_bin("initdb"), "-D", self.data, "-U", "postgres", "--auth=trust", "-E", "UTF8")

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *argv: str) -> None:
        cmd = (["runuser", "-u", "postgres", "--"] if self._as_postgres else []) + list(argv)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=self.dir)

    def start(self) -> "PrivatePostgres":
        self._run(_pg_bin("pg_ctl"), "-D", self.data, "-l", os.path.join(self.dir, "log"), "-w", "-t", "60",
                  "-o", f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c max_connections=200",
                  "start")
        _wait_port(self.port)
        return self

    def stop(self, mode: str = "fast") -> None:
        self._run(_pg_bin("pg_ctl"), "-D", self.data, "-m", mode, "-w", "stop")

    def destroy(self) -> None:
        try:
            self.stop("immediate")
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)


class PrivateRedis:
    """A Redis of our own on a free port; ``appendonly`` set as the test needs."""

    def __init__(self, port: int | None = None, appendonly: bool = False, appendfsync: str = "everysec"):
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="idem-redis-")
        self.args = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir, "--save", "",
                     "--appendonly", "yes" if appendonly else "no", "--appendfsync", appendfsync]
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "PrivateRedis":
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.proc = subprocess.Popen([binary, *self.args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.port)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


_private: dict[str, str] = {}


def postgres_url() -> str:
    """The shared PostgreSQL for tests: the configured one, else a private one."""
    if reachable(POSTGRES_URL):
        return POSTGRES_URL
    if "postgres" not in _private:
        server = PrivatePostgres().start()
        atexit.register(server.destroy)
        _private["postgres"] = server.url
    return _private["postgres"]


def redis_url() -> str:
    """The shared Redis for tests: the configured one, else a private one."""
    if reachable(REDIS_URL):
        return REDIS_URL
    if "redis" not in _private:
        server = PrivateRedis().start()
        atexit.register(server.destroy)
        _private["redis"] = server.url
    return _private["redis"]
