"""A call in flight keeps its run alive (docs/restarts.md).

A run whose current attempt has a request open through the proxy is alive while that
request's client connection is open, whether bytes move or not: a slow tool call, a model
thinking for minutes, a stream idle between events. It is silent only when nothing is open
and no byte has moved for ``timeout_s``. The proxy beats for its open requests (coalesced,
like every heartbeat: once a second per run); a client that leaves, or a proxy that dies,
stops the beats, and silence is counted from there.

Every run here has ``timeout_s = 2`` and a hook that only notes its firing (``watch_exit =
false``): a restart is the supervisor's verdict of silence, nothing else.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import orjson
import pytest

from conftest import proxy_sections, until
from idemproxy.proxy.config import load_settings
from idemproxy.proxy.runs import RunsService
from idemproxy.proxy.store import open_store
from idemproxy.proxy.store.model import Run
from idemproxy.supervisor.hooks import Hooks
from idemproxy.supervisor.loop import Supervisor

pytestmark = pytest.mark.slow  # each waits out calls several times timeout_s long

TIMEOUT_S = 2.0  # above the heartbeat flush period (1 s), so a beating run always looks alive
SLOW_S = 3 * TIMEOUT_S
CHAT = {"model": "m", "messages": [{"role": "user", "content": "think hard"}]}
# Notes each firing (run, epoch) in argv[1], then exits: only silence restarts the run.
TALLY = """
import os, sys
open(sys.argv[1], "a").write(os.environ["IDEM_RUN_ID"] + " " + os.environ["IDEM_EPOCH"] + "\\n")
"""


def _sections(tmp_path: Path) -> dict:
    script = tmp_path / "tally.py"
    script.write_text(TALLY)
    return {"runs": {"timeout_s": TIMEOUT_S, "grace_s": 0.1, "hook": "agent"},
            "hooks__agent": {"command": [sys.executable, str(script), str(tmp_path / "fired.txt")],
                             "log_dir": str(tmp_path / "logs"), "allow_tenants": ["default"],
                             "watch_exit": False}}


@pytest.fixture
async def supervised(make_proxy, store_url, tmp_path, http):
    """``await supervised(run_id) -> proxy``: a proxy with its supervisor (every 0.1 s) and
    the run registered with the hook."""
    async def make(run_id: str):
        proxy = await make_proxy(store_url, supervisor={"enabled": True, "interval_s": 0.1},
                                 server={"shutdown_timeout": 1}, **_sections(tmp_path))
        async with http.post(f"{proxy.url}/runs/{run_id}", json={"hook": "agent"}) as resp:
            assert resp.status == 201
        return proxy
    return make


async def _run(store, run_id: str) -> Run:
    (run,) = await store.runs.find("default", run_id)
    return run


def _restarts(run: Run) -> list[float]:
    return [e["at"] for e in run.history if e["event"] == "restart"]


async def _restarted(store, run_id: str) -> Run | None:
    run = await _run(store, run_id)
    return run if _restarts(run) else None


async def test_a_slow_call_keeps_its_run_alive_and_silence_counts_from_its_end(supervised, http, provider):
    proxy = await supervised("thinker")
    url = f"{proxy.url}/runs/thinker/epochs/0/openai/v1/chat/completions"
    async with http.post(url, json=CHAT, headers={"X-Fake-Delay": str(SLOW_S)}) as resp:
        assert resp.status == 200
        await resp.read()
    ended = time.time()
    run = await _run(proxy.store, "thinker")
    assert (run.epoch, _restarts(run)) == (0, []), "restarted while its call was in flight"
    # nothing else comes (the client's connection stays open, idle, kept alive): silence from here
    run = await until(lambda: _restarted(proxy.store, "thinker"), TIMEOUT_S + 3, "restarted after the call")
    silence = _restarts(run)[0] - ended
    # the last beat is at most a flush period (1 s) before the end, the restart a tick after timeout_s
    assert TIMEOUT_S - 1.2 <= silence <= TIMEOUT_S + 1.0, silence
    assert provider.calls["chat"] == 1


async def test_a_client_that_leaves_stops_keeping_its_run_alive(supervised, provider):
    proxy = await supervised("leaver")
    host, port = proxy.url.removeprefix("http://").split(":")
    body = orjson.dumps(CHAT)
    reader, writer = await asyncio.open_connection(host, int(port))
    asked = time.time()
    writer.write(b"POST /runs/leaver/epochs/0/openai/v1/chat/completions HTTP/1.1\r\n"
                 b"Host: proxy\r\nContent-Type: application/json\r\nX-Fake-Delay: %d\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (int(SLOW_S + TIMEOUT_S), len(body), body))
    await writer.drain()
    await asyncio.sleep(TIMEOUT_S + 1.5)
    assert _restarts(await _run(proxy.store, "leaver")) == [], "restarted while its client waited"
    writer.close()  # the agent goes away; its call goes on upstream (it is recorded) without it
    await writer.wait_closed()
    left = time.time()
    run = await until(lambda: _restarted(proxy.store, "leaver"), TIMEOUT_S + 3, "restarted once the client left")
    restarted = _restarts(run)[0]
    assert restarted - left <= TIMEOUT_S + 1.0, restarted - left
    assert restarted < asked + SLOW_S + TIMEOUT_S, "only the call's end let the run go"
    assert provider.calls["chat"] == 1


async def test_a_passthrough_stream_idle_between_events_is_open(supervised, http):
    proxy = await supervised("listener")
    url = f"{proxy.url}/runs/listener/epochs/0/openai/v1/chat/completions"
    gap = TIMEOUT_S + 0.5  # each event waits longer than timeout_s after the one before
    headers = {"Idem-Policy": "passthrough", "X-Fake-Chunks": "1", "X-Fake-Chunk-Delay": str(gap)}
    started = time.monotonic()
    async with http.post(url, json={**CHAT, "stream": True}, headers=headers) as resp:
        assert resp.status == 200 and resp.headers.get("Idempotent-Replayed") is None
        events = (await resp.read()).count(b"data: ")
    assert events == 3 and time.monotonic() - started > 2 * gap
    assert _restarts(await _run(proxy.store, "listener")) == [], "restarted between two events"
    await until(lambda: _restarted(proxy.store, "listener"), TIMEOUT_S + 3, "restarted after the stream")


async def test_open_calls_keep_a_run_alive_for_a_supervisor_elsewhere_until_their_proxy_dies(
        store_url, provider, proxy_process, tmp_path, http):
    """The proxy in one process, the supervisor in another (this one), one store: the
    liveness of open calls is in the store. A proxy killed mid-call beats no more."""
    sections = proxy_sections(provider.url, store_url, **_sections(tmp_path))
    sections["supervisor"] = {"enabled": False, "interval_s": 0.1}  # the proxy's off: only ours watches
    served = proxy_process(sections)
    settings = load_settings(served.config, env={})
    store = await open_store(settings)
    stop = asyncio.Event()
    supervisor = Supervisor(RunsService(store, settings, Hooks(settings, store)), settings)
    watching = asyncio.create_task(supervisor.run(stop))
    try:
        async with http.post(f"{served.url}/runs/remote", json={"hook": "agent"}) as resp:
            assert resp.status == 201
        url = f"{served.url}/runs/remote/epochs/0/openai/v1/chat/completions"
        async with http.post(url, json=CHAT, headers={"X-Fake-Delay": str(SLOW_S)}) as resp:
            assert resp.status == 200
        assert _restarts(await _run(store, "remote")) == [], "restarted while its call was in flight"

        # a second slow call, and its proxy is killed in the middle of it
        call = asyncio.create_task(http.post(url, json={**CHAT, "messages": [{"role": "user", "content": "2"}]},
                                             headers={"X-Fake-Delay": str(SLOW_S)}))
        await until(lambda: _async(provider.calls["chat"] == 2), 5, "the second call upstream")
        await asyncio.sleep(TIMEOUT_S + 0.5)
        assert _restarts(await _run(store, "remote")) == [], "restarted while its call was in flight"
        os.kill(served.proc.pid, signal.SIGKILL)
        served.proc.wait()
        killed = time.time()
        with pytest.raises(Exception):
            await call
        run = await until(lambda: _restarted(store, "remote"), TIMEOUT_S + 3, "restarted once its proxy died")
        assert _restarts(run)[0] - killed <= TIMEOUT_S + 1.0
    finally:
        stop.set()
        await watching
        await supervisor.runs.launcher.aclose()
        await store.aclose()


async def _async(value):
    return value
