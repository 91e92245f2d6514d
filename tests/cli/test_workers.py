"""`idemproxy serve --workers 2`: processes sharing one port and one store, stopped by SIGTERM."""

from __future__ import annotations

import asyncio
import os
import time

import aiohttp
import pytest

import services
from conftest import proxy_sections

pytestmark = pytest.mark.slow  # idemproxy serve --workers 2 as a subprocess

CHAT = "/openai/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "once across workers"}]}


def children(pid: int) -> set[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return {int(p) for p in f.read().split()}
    except OSError:
        return set()


def listening_on(port: int, pids: set[int]) -> set[int]:
    """Which of ``pids`` hold a listening TCP socket on ``port``."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    found = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    found.add(pid)
        except OSError:
            pass
    return found


async def test_two_workers_share_one_port_and_one_store(proxy_process, sqlite_url, provider):
    proc = proxy_process(proxy_sections(provider.url, sqlite_url, server={"workers": 2}))
    deadline = time.monotonic() + 30
    while len(workers := listening_on(proc.port, children(proc.proc.pid))) < 2:
        assert time.monotonic() < deadline, f"workers listening: {workers}; log: {proc.log.read_text()[-2000:]}"
        await asyncio.sleep(0.1)
    assert proc.proc.pid not in workers  # the parent only supervises

    # a new connection per request, so the kernel spreads them over both workers
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        async def one():
            async with http.post(proc.url + CHAT, json=BODY,
                                 headers={"Idempotency-Key": "w-1", "X-Fake-Delay": "0.5"}) as r:
                return r.status, await r.read()

        results = await asyncio.gather(*(one() for _ in range(40)))
        assert {status for status, _ in results} == {200}
        assert len({body for _, body in results}) == 1
        assert provider.calls["chat"] == 1

        # SIGTERM while a call is in flight: it is answered, then everything exits cleanly
        slow = asyncio.create_task(http.post(proc.url + CHAT, json={**BODY, "n": 2},
                                             headers={"Idempotency-Key": "w-2", "X-Fake-Delay": "1"}))
        while provider.calls["chat"] < 2:
            await asyncio.sleep(0.01)
        proc.proc.terminate()
        resp = await slow
        assert resp.status == 200 and resp.headers["Idempotent-Replayed"] == "false"
        resp.release()
    code = await asyncio.to_thread(proc.proc.wait, 20)
    assert code == 0, proc.log.read_text()[-2000:]
    for pid in workers:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    assert not services.reachable(proc.url, 0.2)
