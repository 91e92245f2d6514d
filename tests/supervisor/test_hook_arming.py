"""Traffic never spawns processes by itself (docs/security.md): a hook fires only for a run
that an authorised party registered (the admin API, or a namespace in the hook's ``allow_tenants``);
registrations are bounded, and so is the supervisor (processes at once, restarts a minute)."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from conftest import proxy_sections
from config_files import write_config
from idemproxy.proxy.config import load_settings
from idemproxy.proxy.runs import RunsService
from idemproxy.proxy.store import open_store
from idemproxy.proxy.store.model import Run
from idemproxy.supervisor.hooks import Hooks
from idemproxy.supervisor.loop import DEFERRED, Supervisor
from rawhttp import problem

ADMIN = {"Authorization": "Bearer test-admin-token"}
# The production limits on registrations (the harness lowers the minimum timeouts).
LIMITS = {"min_timeout_s": 1.0, "min_grace_s": 1.0}
# Appends a line per start (run id, event) to argv[1].
TALLY = "import os, sys; open(sys.argv[1], 'a').write(os.environ['IDEM_RUN_ID'] + ' ' + os.environ['IDEM_EVENT'] + '\\n')"


def _tally(tmp_path: Path, name: str, **extra) -> dict:
    return {"command": [sys.executable, "-c", TALLY, str(tmp_path / f"{name}.txt")],
            "log_dir": str(tmp_path / "logs"), **extra}


def _started(tmp_path: Path, name: str) -> list[str]:
    path = tmp_path / f"{name}.txt"
    return path.read_text().splitlines() if path.exists() else []


async def _call(http, method: str, url: str, **kwargs) -> tuple[int, dict]:
    async with http.request(method, url, **kwargs) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_unauthenticated_registrations_and_traffic_spawn_nothing(make_proxy, sqlite_url, http, tmp_path):
    """Two attacks: 20 registrations asking for hook "agent" with tiny timeouts, and
    fresh Idem-Run headers while ``[runs] hook`` is set, under a live supervisor."""
    proxy = await make_proxy(sqlite_url, supervisor={"enabled": True, "interval_s": 0.05},
                             runs={**LIMITS, "timeout_s": 0.2, "grace_s": 0.1, "hook": "agent", "on_dead": "pager"},
                             hooks__agent=_tally(tmp_path, "agent"), hooks__pager=_tally(tmp_path, "pager"))
    attack = {"hook": "agent", "timeout_s": 0.01, "grace_s": 0.01, "max_restarts": 1000000}
    for i in range(20):
        async with http.post(f"{proxy.url}/runs/x{i}", json=attack) as resp:
            await problem(resp, "outside-limits", 422)
        async with http.post(f"{proxy.url}/runs/y{i}", json={"hook": "agent"}) as resp:  # within limits
            body = await problem(resp, "hook-not-allowed", 403)
            assert body["namespace"] == "default"  # what an operator would list in allow_tenants
    for i in range(5):
        async with http.get(f"{proxy.url}/raw/echo/x", headers={"Idem-Run": f"fresh-{i}"}) as resp:
            assert resp.status == 200
    # the runs traffic made have no hook: silent, they die, and nothing is started for them
    deadline = time.monotonic() + 5
    while len(await proxy.store.runs.list("dead")) < 5:
        assert time.monotonic() < deadline, "the silent runs were not buried"
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # a few more ticks
    assert [r.hook for r in await proxy.store.runs.list()] == [None] * 5
    assert _started(tmp_path, "agent") == [] and _started(tmp_path, "pager") == []
    assert not (tmp_path / "logs").exists()


async def test_a_hook_is_armed_by_an_allowed_namespace_or_the_admin_api(make_proxy, sqlite_url, http, tmp_path):
    proxy = await make_proxy(sqlite_url, tenants={"runs": "credential", "trusted_sources": ["127.0.0.1/32"]},
                             runs={"hook": "agent"}, hooks__agent={"command": ["true"], "allow_tenants": ["acme"]})
    acme = {"Idem-Tenant": "acme"}
    status, run = await _call(http, "POST", f"{proxy.url}/runs/by-acme", headers=acme, json={"hook": "agent"})
    assert status == 201 and run["hook"] == "agent"
    status, run = await _call(http, "POST", f"{proxy.url}/runs/default-hook", headers=acme)
    assert status == 201 and run["hook"] == "agent"  # the [runs] default, for a namespace it allows
    async with http.post(f"{proxy.url}/runs/by-acme/epochs/0/raw/echo/x", headers=acme) as resp:
        assert resp.status == 200
    async with http.post(f"{proxy.url}/runs/made-by-traffic/raw/echo/x", headers=acme) as resp:
        assert resp.status == 200
    _, made = await _call(http, "GET", f"{proxy.url}/runs/made-by-traffic", headers=acme)
    assert made["hook"] == "agent"

    anyone = {"Authorization": "Bearer sk-someone"}
    async with http.post(f"{proxy.url}/runs/mine", headers=anyone, json={"hook": "agent"}) as resp:
        refused = await problem(resp, "hook-not-allowed", 403)
    status, _ = await _call(http, "GET", f"{proxy.url}/runs/mine", headers=anyone)
    assert status == 404  # the refusal changed nothing
    status, run = await _call(http, "POST", f"{proxy.url}/runs/mine", headers=anyone)
    assert status == 201 and run["hook"] is None  # the [runs] default is not theirs to arm
    async with http.post(f"{proxy.url}/runs/traffic/raw/echo/x", headers=anyone) as resp:
        assert resp.status == 200
    assert (await _call(http, "GET", f"{proxy.url}/runs/traffic", headers=anyone))[1]["hook"] is None

    # an operator arms it in the caller's namespace; the caller may name it again, not another
    status, run = await _call(http, "POST", f"{proxy.url}/admin/runs/mine?namespace={refused['namespace']}",
                              headers=ADMIN, json={"hook": "agent", "timeout_s": 30})
    assert status == 200 and (run["hook"], run["timeout_s"]) == ("agent", 30)
    status, run = await _call(http, "POST", f"{proxy.url}/runs/mine", headers=anyone,
                              json={"hook": "agent", "metadata": {"step": 2}})
    assert status == 200 and run["hook"] == "agent"
    status, run = await _call(http, "POST", f"{proxy.url}/admin/runs/new-one?namespace=acme", headers=ADMIN)
    assert status == 201 and run["hook"] == "agent"  # operators get the [runs] default
    async with http.post(f"{proxy.url}/admin/runs/nowhere", headers=ADMIN) as resp:
        await problem(resp, "not-found", 404)  # a new run needs its namespace named
    async with http.post(f"{proxy.url}/admin/runs/x?namespace=a%20b", headers=ADMIN) as resp:
        await problem(resp, "invalid-request", 400)


async def test_registrations_stay_within_the_configured_limits(make_proxy, sqlite_url, http):
    proxy = await make_proxy(sqlite_url, runs={**LIMITS, "max_restarts_limit": 10, "max_metadata_bytes": 100})
    for body, bound in (({"timeout_s": 0.5}, "min_timeout_s"), ({"grace_s": "100ms"}, "min_grace_s"),
                        ({"max_restarts": 11}, "max_restarts_limit"),
                        ({"metadata": {"blob": "x" * 100}}, "max_metadata_bytes")):
        async with http.post(f"{proxy.url}/runs/bounded", json=body) as resp:
            assert bound in (await problem(resp, "outside-limits", 422))
    status, _ = await _call(http, "GET", f"{proxy.url}/runs/bounded")
    assert status == 404  # nothing was created by the refusals
    status, run = await _call(http, "POST", f"{proxy.url}/runs/bounded", json={
        "timeout_s": 1, "grace_s": 1, "max_restarts": 10, "metadata": {"blob": "x" * 80}})
    assert status == 201 and run["max_restarts"] == 10


@pytest.fixture
async def lone_supervisor(tmp_path, sqlite_url):
    """``await lone_supervisor(hook, **supervisor_settings) -> (supervisor, store)``: no proxy,
    hook ``agent`` as given, and no run yet."""
    made = []

    async def make(hook: dict, **supervisor):
        sections = proxy_sections("http://127.0.0.1:9", sqlite_url, supervisor=supervisor, hooks__agent=hook)
        settings = load_settings(write_config(tmp_path / "lone.toml", sections), env={})
        store = await open_store(settings)
        hooks = Hooks(settings, store)
        made.append((hooks, store))
        return Supervisor(RunsService(store, settings, hooks), settings), store

    yield make
    for hooks, store in made:
        await hooks.aclose()
        await store.aclose()


async def _silent_runs(store, n: int, at: float) -> None:
    """``n`` runs silent since ``at``; once restarted, they stay alive for 100 s."""
    for i in range(n):
        await store.runs.upsert(Run("default", f"quiet-{i}", last_seen=at, started_at=at, created_at=at,
                                    timeout_s=100, grace_s=1, max_restarts=5, hook="agent"))


@pytest.mark.slow  # starts hook processes and waits for them to end
async def test_the_supervisor_runs_at_most_max_hook_processes_at_once(lone_supervisor, tmp_path):
    sleeper = {"command": [sys.executable, "-c", "import time; time.sleep(1.5)"], "log_dir": str(tmp_path / "logs")}
    supervisor, store = await lone_supervisor(sleeper, max_hook_processes=2)
    now = time.time()
    await _silent_runs(store, 4, now - 1000)
    done = await supervisor.tick(now)
    assert sorted(action for _, action in done) == [DEFERRED, DEFERRED, "restart", "restart"]
    assert not supervisor.runs.launcher.has_room()
    waiting = [run_id for run_id, action in done if action == DEFERRED]
    for run_id in waiting:  # deferred, not counted: still at epoch 0, no restart spent
        (run,) = await store.runs.find("default", run_id)
        assert (run.epoch, run.restarts, run.restart_times) == (0, 0, [])
    # an operator's restart is held to the same bound: the hook is refused, and recorded so
    new = await supervisor.runs.restart_now(waiting[0], by="admin:test")
    (run,) = await store.runs.find("default", new.run_id)
    assert "max_hook_processes" in run.history[-1]["error"]

    deadline = time.monotonic() + 10
    while not supervisor.runs.launcher.has_room():  # the first two end, and are reaped
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    assert [action for _, action in await supervisor.tick(now + 1)].count("restart") == 1


@pytest.fixture
async def receiver():
    """An HTTP hook's receiver that counts the restarts it is told of."""
    told: list[dict] = []

    async def hook(request: web.Request) -> web.Response:
        told.append(await request.json())
        return web.Response(status=204)
    app = web.Application()
    app.router.add_post("/restart", hook)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("/restart")), told
    await server.close()


async def test_the_supervisor_restarts_at_most_max_restarts_per_minute(lone_supervisor, receiver):
    url, told = receiver
    supervisor, store = await lone_supervisor({"url": url}, max_restarts_per_minute=2)
    now = time.time()
    await _silent_runs(store, 5, now - 1000)
    # a supervisor claims no more runs than it may restart (one at its bound: a run to bury needs
    # no room), and lets go of what it defers; the others stay unclaimed, for a replica with room
    assert sorted(a for _, a in await supervisor.tick(now)) == [DEFERRED] + ["restart"] * 2
    assert sorted(a for _, a in await supervisor.tick(now + 30)) == [DEFERRED]  # the same minute
    assert sorted(a for _, a in await supervisor.tick(now + 61)) == [DEFERRED] + ["restart"] * 2
    await supervisor.runs.launcher.wait_idle()
    assert len(told) == 4 and len({t["run_id"] for t in told}) == 4
