"""Store outages and dead claim holders, through real proxy processes.

A PostgreSQL or Redis of the test's own is stopped under light load: `record` requests
fail closed with 503 `store-unavailable` within a bound, are never forwarded, and
`passthrough` keeps working; once the server is back the proxy recovers by itself, and
every record it acknowledged before is still replayed. (The in-process Redis variant
without load is in test_store_redis.py; this one adds load, a proxy process and a Redis
with `appendfsync always`, so acknowledged records must survive the outage too.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from dataclasses import dataclass

import aiohttp
import orjson
import pytest

from conftest import BACKENDS, backend_url, proxy_sections
from rawhttp import problem
from services import PrivatePostgres, PrivateRedis, children

pytestmark = pytest.mark.slow  # private PostgreSQL/Redis taken away under load, real proxy processes, SIGKILL

CHAT = "/openai/v1/chat/completions"
TOOL = "/tools/send"
STORE_TIMEOUT_S = 1.0
# what a record request may take during an outage: one store operation that times out, plus
# the upstream call (0.05 s) when the store went away between claim and record
RECORD_BOUND_S = 1.5
RECOVERY_BOUND_S = 15.0


@dataclass
class Outcome:
    mark: str
    kind: str
    started: float
    ended: float
    status: int | None  # None: the client gave up (the proxy hung) or the connection failed
    replayed: str | None
    body: bytes

    @property
    def took(self) -> float:
        return self.ended - self.started


def record_request(base: str, kind: str, mark: str, epoch: int = 0) -> tuple[str, dict, dict]:
    """One of three kinds of record request, each carrying ``mark`` in its body."""
    said = {"model": "m", "messages": [{"role": "user", "content": mark}]}
    if kind == "explicit":
        return base + CHAT, said, {"Idempotency-Key": mark}
    if kind == "tool":
        return base + TOOL, {"mark": mark}, {"Idempotency-Key": mark}
    return f"{base}/runs/{mark}/epochs/{epoch}{CHAT}", said, {}  # a derived key: the run's first call


async def send(http: aiohttp.ClientSession, base: str, kind: str, mark: str, epoch: int = 0,
               extra: dict | None = None) -> Outcome:
    url, body, headers = record_request(base, kind, mark, epoch)
    started = time.monotonic()
    try:
        async with http.post(url, json=body, headers={**headers, **(extra or {})}) as r:
            data = await r.read()
            if r.status == 503:
                await problem(r, "store-unavailable", 503)
            return Outcome(mark, kind, started, time.monotonic(), r.status,
                           r.headers.get("Idempotent-Replayed"), data)
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return Outcome(mark, kind, started, time.monotonic(), None, None, b"")


class Load:
    """A few clients sending record requests with fresh keys, in a bounded loop."""

    KINDS = ("explicit", "tool", "derived")

    def __init__(self, http: aiohttp.ClientSession, base: str, clients: int = 4, most: int = 300):
        self.http, self.base = http, base
        self.outcomes: list[Outcome] = []
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._client(i, most)) for i in range(clients)]

    async def _client(self, i: int, most: int) -> None:
        for n in range(most):
            if self._stop.is_set():
                return
            mark = f"load-{i}-{n}-{uuid.uuid4().hex[:6]}"
            self.outcomes.append(await send(self.http, self.base, self.KINDS[n % 3], mark,
                                            extra={"X-Fake-Delay": "0.05"}))
            await asyncio.sleep(0.02)

    def acknowledged(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == 200]

    async def until_acknowledged(self, n: int, within: float = 10.0) -> None:
        deadline = time.monotonic() + within
        while len(self.acknowledged()) < n:
            assert time.monotonic() < deadline, f"only {len(self.acknowledged())} records acknowledged"
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


def forwarded_marks(provider) -> set[str]:
    """The marks of every request that reached the fake upstream."""
    marks = set()
    for seen in provider.seen:
        if seen["body"]:
            body = orjson.loads(seen["body"])
            marks.add(body.get("mark") or body["messages"][-1]["content"])
    return marks


class PrivateServer:
    """A private PostgreSQL or Redis that the test takes away: ``stopped`` (the server is
    gone, connections are refused) or ``frozen`` (SIGSTOP: it accepts connections and never
    answers, like a partitioned or wedged host)."""

    def __init__(self, backend: str):
        self.backend = backend
        self._frozen: list[int] = []
        if backend == "postgres":
            self.server = PrivatePostgres()
            self.store_url = f"{self.server.url}?schema=outage"
        else:  # every acknowledged write fsynced: an acknowledged record survives a Redis restart
            self.server = PrivateRedis(appendonly=True, appendfsync="always")
            self.store_url = f"{self.server.url}?prefix=outage:"

    async def start(self) -> None:
        await asyncio.to_thread(self.server.start)

    async def take_away(self, mode: str) -> None:
        if mode == "stopped":
            await asyncio.to_thread(self.server.stop)  # PostgreSQL: fast shutdown; Redis: SIGKILL
            return
        if self.backend == "postgres":  # the postmaster first, so it forks no new backend meanwhile
            with open(os.path.join(self.server.data, "postmaster.pid")) as f:
                main = int(f.readline())
            os.kill(main, signal.SIGSTOP)
            self._frozen = [main, *children(main)]
        else:
            self._frozen = [self.server.proc.pid]
        for pid in self._frozen:
            os.kill(pid, signal.SIGSTOP)

    async def bring_back(self, mode: str) -> None:
        if mode == "stopped":
            await self.start()  # same port, same data
            return
        for pid in self._frozen:
            os.kill(pid, signal.SIGCONT)
        self._frozen = []

    def destroy(self) -> None:
        for pid in self._frozen:
            os.kill(pid, signal.SIGCONT)
        self.server.destroy()


@pytest.fixture
async def private_server(request):
    server = await asyncio.to_thread(PrivateServer, request.param)
    await server.start()
    yield server
    await asyncio.to_thread(server.destroy)


@pytest.fixture
async def client():
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


@pytest.mark.parametrize("mode", ["stopped", "frozen"])
@pytest.mark.parametrize("private_server", [b for b in ("postgres", "redis") if b in BACKENDS], indirect=True)
async def test_store_outage_under_load(private_server, mode, proxy_process, provider, client):
    sections = proxy_sections(provider.url, private_server.store_url, store={"timeout": f"{STORE_TIMEOUT_S}s"},
                              server={"in_flight_wait": "2s"})
    proxy = await asyncio.to_thread(proxy_process, sections)
    load = Load(client, proxy.url)
    await load.until_acknowledged(20)

    stopping = time.monotonic()
    await private_server.take_away(mode)
    stopped = time.monotonic()
    checks = []  # (readyz status, passthrough status) while the server is down
    while time.monotonic() - stopped < 3.0:
        async with client.get(proxy.url + "/readyz") as r:
            if r.status == 503:
                await problem(r, "store-unavailable", 503)
            ready = r.status
        async with client.get(proxy.url + "/raw/echo/x") as r:
            checks.append((ready, r.status))
        await asyncio.sleep(0.2)
    restarting = time.monotonic()
    await private_server.bring_back(mode)
    back = time.monotonic()

    n = 0
    while True:  # the proxy recovers by itself: nobody restarts it
        n += 1
        outcome = await send(client, proxy.url, "explicit", f"recovered-{n}")
        if outcome.status == 200:
            break
        assert outcome.status == 503, outcome
        assert time.monotonic() - back < RECOVERY_BOUND_S, "the proxy did not recover by itself"
        await asyncio.sleep(0.1)
    recovered = time.monotonic() - back
    await asyncio.sleep(0.5)  # some load after the recovery too
    await load.stop()

    outcomes = load.outcomes
    during = [o for o in outcomes if o.started > stopped and o.ended < restarting]
    first_503 = min(o.ended for o in outcomes if o.status == 503 and o.ended >= stopping)
    print(f"\n[{private_server.backend} {mode}] {len(outcomes)} load requests, "
          f"{len(load.acknowledged())} acknowledged; stop took {stopped - stopping:.2f}s; "
          f"first 503 {first_503 - stopping:.2f}s after the stop began; "
          f"{len(during)} record requests during the outage, slowest {max(o.took for o in during):.2f}s "
          f"(slowest overall {max(o.took for o in outcomes):.2f}s); recovered {recovered:.2f}s after the "
          f"server was back")

    assert {o.status for o in outcomes} <= {200, 503}, [o for o in outcomes if o.status not in (200, 503)][:3]
    assert max(o.took for o in outcomes) < RECORD_BOUND_S  # never hangs, not even at the moment of the stop
    assert len(during) >= 4 and {o.status for o in during} == {503}
    assert not {o.mark for o in during} & forwarded_marks(provider)  # never forwarded unjournaled
    assert checks and all(ready == 503 for ready, _ in checks)  # /readyz reports the outage
    assert all(passed == 200 for _, passed in checks)  # passthrough needs no store
    assert recovered < RECOVERY_BOUND_S
    async with client.get(proxy.url + "/readyz") as r:
        assert r.status == 200

    # no acknowledged record is lost: each one is replayed, byte for byte, with no new call
    spent = sum(provider.calls.values())
    acknowledged = load.acknowledged()
    assert any(o.ended < stopping for o in acknowledged) and any(o.started > back for o in acknowledged)
    for o in acknowledged:
        again = await send(client, proxy.url, o.kind, o.mark, epoch=1)
        assert (again.status, again.replayed, again.body) == (200, "true", o.body), (o.mark, again)
    assert sum(provider.calls.values()) == spent

    # a key answered 503 and never forwarded is free: the client's retry goes upstream at once
    # (a claim the proxy gave up on must not commit later and block the key for a lease).
    # Derived keys are left out: a retry in the same epoch is the run's next occurrence.
    forwarded = forwarded_marks(provider)
    refused = [o for o in outcomes if o.status == 503 and o.kind != "derived" and o.mark not in forwarded]
    assert len(refused) >= 4
    for o in refused:
        again = await send(client, proxy.url, o.kind, o.mark)
        assert (again.status, again.replayed) == (200, "false"), (o.mark, again, again.body[:300])
        assert again.took < 1.0
    assert sum(provider.calls.values()) == spent + len(refused)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_dead_claim_holder_lease_expires_into_on_ambiguous(backend, tmp_path, proxy_process, provider,
                                                                 client):
    """SIGKILL a proxy holding claims on a retry (openai) and a quarantine (tools) upstream;
    the next attempts, on another proxy process, wait out the lease and then follow on_ambiguous."""
    url, cleanup = backend_url(backend, tmp_path)
    sections = proxy_sections(provider.url, url, store={"lease": "2s"})
    procs = []
    try:
        procs = await asyncio.gather(*(asyncio.to_thread(proxy_process, sections) for _ in range(2)))
        doomed, survivor = procs
        slow = {"X-Fake-Delay": "5"}
        held = [asyncio.create_task(send(client, doomed.url, kind, f"held-{kind}", extra=slow))
                for kind in ("explicit", "tool")]
        deadline = time.monotonic() + 10
        while provider.calls["chat"] < 1 or provider.calls["tool:send"] < 1:
            assert time.monotonic() < deadline, dict(provider.calls)
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # a lease renewal or so has happened: the claims are live
        doomed.kill()
        killed = time.monotonic()
        assert [o.status for o in await asyncio.gather(*held)] == [None, None]

        # the next attempts arrive while the dead proxy's lease still runs: they wait it out
        retried, quarantined = await asyncio.gather(send(client, survivor.url, "explicit", "held-explicit"),
                                                    send(client, survivor.url, "tool", "held-tool"))
        print(f"\n[{backend}] retry answered {retried.ended - killed:.2f}s, quarantine answered "
              f"{quarantined.ended - killed:.2f}s after the SIGKILL (lease 2 s)")
        assert (retried.status, retried.replayed) == (200, "false")  # retry: upstream again
        assert provider.calls["chat"] == 2
        assert quarantined.status == 502  # quarantine: outcome unknown, never sent again
        assert orjson.loads(quarantined.body)["type"].endswith("/outcome-unknown")
        assert provider.calls["tool:send"] == 1
        for o in (retried, quarantined):
            assert 0.5 < o.ended - killed < 2.0 + 0.5 + 1.0  # after the lease, within a poll or so

        again = await send(client, survivor.url, "explicit", "held-explicit")
        assert (again.status, again.replayed, again.body) == (200, "true", retried.body)
        again = await send(client, survivor.url, "tool", "held-tool")
        assert again.status == 502 and provider.calls["tool:send"] == 1
    finally:
        for proc in procs:
            await asyncio.to_thread(proc.stop)
        await asyncio.to_thread(cleanup)
