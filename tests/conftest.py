"""Fixtures that start real things: the fake provider, proxies, stores on real servers.

``store_url`` is parametrized over every backend in ``IDEMPROXY_TEST_BACKENDS``
(default: all three), so a test that takes it runs on sqlite, postgres and redis.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

sys.path.insert(0, str(Path(__file__).parent / "support"))

import fake_provider  # noqa: E402
from config_files import write_config  # noqa: E402
import services  # noqa: E402

from idemproxy.proxy.appkeys import PROXY, STORE  # noqa: E402
from idemproxy.proxy.cli.serving import build_app  # noqa: E402
from idemproxy.proxy.config import Settings, load_settings  # noqa: E402
from idemproxy.proxy.data_plane import open_planes  # noqa: E402

BACKENDS = [b for b in os.environ.get("IDEMPROXY_TEST_BACKENDS", "sqlite,postgres,redis").split(",") if b]
REPO = Path(__file__).resolve().parent.parent


@dataclass
class Provider:
    url: str
    app: web.Application

    @property
    def calls(self):
        return self.app[fake_provider.CALLS]

    @property
    def seen(self) -> list[dict]:
        return self.app[fake_provider.SEEN]


@pytest.fixture
async def provider() -> Provider:
    app = fake_provider.create_app()
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield Provider(str(server.make_url("")).rstrip("/"), app)
    await closed_within(server.close(), "the fake provider")


def _drop_postgres_schema(url: str, schema: str) -> None:
    import asyncpg

    async def drop():
        conn = await asyncpg.connect(url)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await conn.close()
    asyncio.run(drop())


def _drop_redis_prefix(url: str, prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=prefix + "*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def backend_url(backend: str, tmp_path: Path) -> tuple[str, Any]:
    """A fresh, empty store of ``backend`` and how to clean it up."""
    tag = uuid.uuid4().hex[:10]
    if backend == "sqlite":
        return f"sqlite:///{tmp_path}/journal-{tag}.db", lambda: None
    if backend == "postgres":
        base, schema = services.postgres_url(), f"t_{tag}"
        return f"{base}?schema={schema}", lambda: _drop_postgres_schema(base, schema)
    if backend == "redis":
        base, prefix = services.redis_url(), f"t{tag}:"
        return f"{base}?prefix={prefix}", lambda: _drop_redis_prefix(base, prefix)
    if backend == "redis-cluster":  # by choice only: tests/store/test_store_redis_cluster.py runs in CI
        import redis_cluster
        return f"{redis_cluster.shared_url()}/?prefix=t{tag}:", lambda: None  # the cluster goes at exit
    raise ValueError(backend)


@pytest.fixture(params=BACKENDS)
def store_url(request, tmp_path):
    url, cleanup = backend_url(request.param, tmp_path)
    yield url
    cleanup()


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path}/journal.db"


async def until(predicate, timeout: float, what: str):
    """``await predicate()`` every 10 ms until it gives something true, which is returned;
    AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(0.01)
    raise AssertionError(f"not within {timeout}s: {what}")


def proxy_sections(provider_url: str, store_url: str, **extra: dict[str, Any]) -> dict[str, dict]:
    """A test configuration: fake provider as openai, anthropic and tools."""
    sections: dict[str, dict[str, Any]] = {
        "server": {"host": "127.0.0.1", "port": 0, "in_flight_wait": "5s", "access_log": False},
        "store": {"url": store_url, "timeout": "3s"},
        "upstreams.openai": {"url": provider_url},
        "upstreams.anthropic": {"url": provider_url},
        "upstreams.tools": {"url": provider_url + "/tools", "on_ambiguous": "quarantine",
                            "idempotency_header": "Idempotency-Key"},
        "upstreams.raw": {"url": provider_url, "kind": "tool"},
        "supervisor": {"enabled": False},
        "admin": {"token": "test-admin-token"},
        # Most tests are about one agent whose calls carry several credentials (or none): they
        # choose one shared namespace for runs, explicitly, and wait out timeouts in fractions
        # of a second. Tests of namespaces and of registration limits set their own.
        # Most tests also call without a credential; the default, refusing to record such
        # calls, is tested in test_tenants.py with tenants={"anonymous": "refuse"}.
        "tenants": {"runs": "shared", "anonymous": "shared"},
        "runs": {"min_timeout_s": 0.01, "min_grace_s": 0.01},
    }
    for name, body in extra.items():
        sections.setdefault(name.replace("__", "."), {}).update(body)
    return sections


@dataclass
class RunningProxy:
    url: str
    app: web.Application
    settings: Settings
    server: TestServer

    @property
    def store(self):
        return self.app[STORE]

    @property
    def proxy(self):
        return self.app[PROXY]


@pytest.fixture
async def make_proxy(request, tmp_path, provider):
    """Start a proxy on a real socket: ``await make_proxy(store_url, **sections)``."""
    if "store_url" in request.fixturenames:
        # set the store up first, so it is torn down (schema dropped) after the proxies close
        request.getfixturevalue("store_url")
    started: list[TestServer] = []

    async def make(store_url: str, **extra: dict[str, Any]) -> RunningProxy:
        # the port is chosen first: it is what hooks are told (supervisor.proxy_url)
        port = services.free_port()
        sections = proxy_sections(provider.url, store_url, **extra)
        sections.setdefault("supervisor", {}).setdefault("proxy_url", f"http://127.0.0.1:{port}")
        path = write_config(tmp_path / f"proxy-{uuid.uuid4().hex[:6]}.toml", sections)
        settings = load_settings(path, env={})
        app = build_app(settings, supervise=settings.supervisor.enabled)
        server = TestServer(app, host="127.0.0.1", port=port)
        await server.start_server()
        open_planes(server.runner)  # as `idemproxy serve` does; no connection has come yet
        started.append(server)
        return RunningProxy(str(server.make_url("")).rstrip("/"), app, settings, server)

    yield make
    for server in reversed(started):
        await closed_within(server.close(), "a proxy")


async def closed_within(closing, what: str, seconds: float = 25.0) -> None:
    """Close a test server; if that hangs, print what the closing and every other task wait
    on (before cancelling, so the closing task's own stack is still there), then fail."""
    task = asyncio.ensure_future(closing)
    done, _ = await asyncio.wait([task], timeout=seconds)
    if not done:
        for other in asyncio.all_tasks():
            print(f"{other!r} awaits:\n{awaited_chain(other.get_coro())}", file=sys.stderr)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise AssertionError(f"{what} did not close within {seconds:g} s: its tasks are above")
    task.result()


def awaited_chain(coro: Any) -> str:
    """Every frame a suspended coroutine waits through, down to the future at the bottom
    (a task's own stack shows only its outermost frame)."""
    lines = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            lines.append(f"  {coro!r}")
            break
        lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None) or getattr(coro, "gi_yieldfrom", None)
    return "\n".join(lines)


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


class ProxyProcess:
    """``idemproxy serve`` in a subprocess, for tests that kill it."""

    def __init__(self, config: Path, port: int, env: dict[str, str] | None = None):
        self.config, self.port = config, port
        self.url = f"http://127.0.0.1:{port}"
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.log = config.with_suffix(f".{port}.log")

    def start(self, timeout: float = 20.0) -> "ProxyProcess":
        with open(self.log, "ab") as out:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "idemproxy.proxy.cli", "serve", "--config", str(self.config),
                 "--port", str(self.port)], stdout=out, stderr=out, env=self.env, cwd=self.config.parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"proxy exited: {self.log.read_text()[-3000:]}")
            if services.reachable(self.url, 0.2):
                return self
            time.sleep(0.05)
        raise RuntimeError(f"proxy did not start: {self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def proxy_process(tmp_path):
    """Factory: ``proxy_process(sections) -> ProxyProcess`` (started); stopped at teardown."""
    made: list[ProxyProcess] = []

    def make(sections: dict[str, dict[str, Any]], port: int | None = None,
             env: dict[str, str] | None = None) -> ProxyProcess:
        port = port or services.free_port()
        sections = {**sections, "server": {**sections.get("server", {}), "port": port}}
        config = write_config(tmp_path / f"proc-{uuid.uuid4().hex[:6]}.toml", sections)
        proc = ProxyProcess(config, port, env).start()
        made.append(proc)
        return proc

    yield make
    for proc in made:
        proc.stop()
