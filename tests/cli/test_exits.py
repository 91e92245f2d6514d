"""A hook-started agent is watched as a child: its exit without complete/fail restarts the
run at once, whatever ``timeout_s`` says (docs/restarts.md#noticing-a-death-at-once).

Every proxy here runs its supervisor at the default ``interval_s = 1`` with ``timeout_s =
60``: a restart within a second can only come from the exit itself. The agents are real
processes started by the command hook (stdlib only, so they start in ~30 ms).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from conftest import until
from idemproxy.proxy.store.model import Run

pytestmark = pytest.mark.slow  # agent processes, killed and restarted

ADMIN = {"Authorization": "Bearer test-admin-token"}
# An agent: says it is up (epoch, pid) in argv[1], then does what argv[2] says for its epoch:
# "sleep" (until killed), "exit:N" (without ending the run), "complete", "fail" (then exit 1).
AGENT = """
import json, os, sys, time, urllib.request
epoch = int(os.environ["IDEM_EPOCH"])
open(sys.argv[1], "a").write(json.dumps({"epoch": epoch, "pid": os.getpid(), "t": time.time()}) + "\\n")
plan = dict(item.split("=", 1) for item in sys.argv[2].split(","))
what = plan.get(str(epoch), plan.get("*", "sleep"))
if what in ("complete", "fail"):
    url = os.environ["IDEM_PROXY_URL"] + "/runs/" + os.environ["IDEM_RUN_ID"] + "/" + what
    urllib.request.urlopen(urllib.request.Request(url, method="POST", headers={"Idem-Epoch": str(epoch)}),
                           timeout=10).read()
    sys.exit(1 if what == "fail" else 0)
if what.startswith("exit:"):
    sys.exit(int(what[5:]))
time.sleep(600)
"""


@pytest.fixture
def agent(tmp_path):
    """``agent(plan) -> (hook section, started-file)``: the hook that starts AGENT with ``plan``
    (``"1=sleep,2=complete"``: by epoch; ``*`` for any other)."""
    script = tmp_path / "agent.py"
    script.write_text(AGENT)

    def make(plan: str, **hook) -> tuple[dict, Path]:
        started = tmp_path / f"started-{len(list(tmp_path.glob('started-*')))}.jsonl"
        return {"command": [sys.executable, str(script), str(started), plan],
                "log_dir": str(tmp_path / "logs"), "allow_tenants": ["default"], **hook}, started
    return make


@pytest.fixture
async def watched(make_proxy, store_url, agent, http):
    """``await watched(plan, **runs) -> (proxy, started-file)``: a proxy and its supervisor
    (``interval_s = 1``), a run ``r`` registered with ``timeout_s = 60`` and the agent hook,
    and its first hook-started attempt (epoch 1) begun."""
    async def make(plan: str, hook: dict | None = None, **runs):
        section, started = agent(plan, **(hook or {}))
        proxy = await make_proxy(store_url, supervisor={"enabled": True, "interval_s": 1.0},
                                 runs={"timeout_s": 60, "grace_s": 30, "backoff_base_s": 0.2, **runs},
                                 hooks__agent=section)
        async with http.post(f"{proxy.url}/runs/r", json={"hook": "agent"}) as resp:
            assert resp.status == 201
        async with http.post(f"{proxy.url}/admin/runs/r/restart", headers=ADMIN) as resp:
            assert resp.status == 200 and (await resp.json())["epoch"] == 1
        await until(lambda: started_at(started, 1), 10, "first attempt up")
        return proxy, started
    return make


async def started_at(path: Path, epoch: int) -> dict | None:
    lines = path.read_text().splitlines() if path.exists() else []
    return next((e for e in map(json.loads, lines) if e["epoch"] == epoch), None)


async def the_run(proxy) -> Run:
    (run,) = await proxy.store.runs.find("default", "r")
    return run


async def at_epoch(proxy, epoch: int) -> Run | None:
    run = await the_run(proxy)
    return run if run.epoch >= epoch else None


def restart_at(run: Run, epoch: int) -> float:
    return next(e["at"] for e in run.history if e["event"] == "restart" and e["epoch"] == epoch)


def exits(run: Run) -> list[dict]:
    return [{k: e.get(k) for k in ("epoch", "code", "signal", "lost")}
            for e in run.history if e["event"] == "hook-exit"]


async def test_an_agent_killed_by_sigkill_is_restarted_within_a_second(watched, store_url):
    proxy, started = await watched("1=sleep,2=complete")
    first = await started_at(started, 1)
    killed = time.time()
    os.kill(first["pid"], signal.SIGKILL)
    run = await until(lambda: at_epoch(proxy, 2), 5, "restarted")
    detected = restart_at(run, 2) - killed
    assert detected < 1.0, detected  # timeout_s is 60, the supervisor ticks every second
    second = await until(lambda: started_at(started, 2), 10, "second attempt up")
    run = await until(lambda: _ended(proxy), 10, "second attempt completed")
    assert (run.state, run.epoch, run.restarts) == ("completed", 2, 2)
    assert exits(run)[0] == {"epoch": 1, "code": None, "signal": "SIGKILL", "lost": True}
    figures = {"store": store_url.split(":")[0], "kill_to_restart_s": round(detected, 4),
               "kill_to_new_process_s": round(second["t"] - killed, 4)}
    print(f"\nEXIT FIGURES {json.dumps(figures)}")


async def test_a_clean_exit_without_complete_is_a_crash(watched):
    proxy, started = await watched("1=exit:0,2=complete")
    run = await until(lambda: _ended(proxy), 10, "restarted and completed")
    assert (run.state, run.epoch) == ("completed", 2)
    assert exits(run)[0] == {"epoch": 1, "code": 0, "signal": None, "lost": True}
    assert restart_at(run, 2) - (await started_at(started, 1))["t"] < 1.0


@pytest.mark.parametrize("end, state, code", [("complete", "completed", 0), ("fail", "failed", 1)])
async def test_an_agent_that_completes_or_fails_is_never_restarted(watched, end, state, code):
    proxy, started = await watched(f"1={end}")
    await until(lambda: _exit_recorded(proxy), 10, "the agent's exit recorded")
    await asyncio.sleep(1.5)  # more than a supervisor tick
    run = await the_run(proxy)
    assert (run.state, run.epoch, run.restarts) == (state, 1, 1)
    assert exits(run) == [{"epoch": 1, "code": code, "signal": None, "lost": None}]


async def test_a_superseded_attempts_exit_changes_nothing(watched, http, provider):
    proxy, started = await watched("*=sleep,3=complete")
    async with http.post(f"{proxy.url}/admin/runs/r/restart", headers=ADMIN) as resp:
        assert (await resp.json())["epoch"] == 2  # an operator starts attempt 2 meanwhile
    zombie, current = await started_at(started, 1), await until(lambda: started_at(started, 2), 10, "2 up")
    os.kill(zombie["pid"], signal.SIGKILL)
    await until(lambda: _exit_recorded(proxy), 5, "the zombie's exit recorded")
    await asyncio.sleep(1.2)
    run = await the_run(proxy)
    assert (run.epoch, run.state, run.lost_epoch) == (2, "restarting", None)
    assert exits(run) == [{"epoch": 1, "code": None, "signal": "SIGKILL", "lost": None}]
    # the zombie's epoch is fenced; the current attempt's death restarts the run
    async with http.post(f"{proxy.url}/runs/r/epochs/1/openai/v1/chat/completions", json={"model": "m"}) as resp:
        assert resp.status == 412
    assert provider.calls["chat"] == 0
    os.kill(current["pid"], signal.SIGTERM)
    run = await until(lambda: _ended(proxy), 10, "restarted after the current attempt died")
    assert (run.state, run.epoch) == ("completed", 3)
    assert exits(run)[1] == {"epoch": 2, "code": None, "signal": "SIGTERM", "lost": True}


async def test_a_crash_loop_backs_off_and_ends_dead_without_waiting_for_timeouts(watched):
    proxy, started = await watched("*=exit:3", max_restarts=3, restart_window_s=60)
    run = await until(lambda: _ended(proxy), 10, "dead")
    # the operator's start (epoch 1) does not count; the supervisor's three restarts do
    assert (run.state, run.epoch, run.restarts) == ("dead", 4, 4)
    restarts = [e["at"] for e in run.history if e["event"] == "restart"]
    gaps = [b - a for a, b in zip(restarts, restarts[1:])]
    # backoff (0.2 s, then 0.4 s) plus at most a supervisor tick; never timeout_s (60 s)
    assert len(restarts) == 3 and 0.2 <= gaps[0] < 1.5 and 0.4 <= gaps[1] < 1.7, gaps
    assert [e["code"] for e in exits(run)] == [3, 3, 3, 3]


async def test_a_launcher_hook_is_not_watched(watched):
    proxy, started = await watched("*=exit:0", hook={"watch_exit": False})
    await until(lambda: _exit_recorded(proxy), 5, "the launcher's exit recorded")
    await asyncio.sleep(1.2)
    run = await the_run(proxy)
    assert (run.state, run.epoch, run.lost_epoch) == ("restarting", 1, None)  # silence decides
    assert exits(run) == [{"epoch": 1, "code": 0, "signal": None, "lost": None}]


async def _ended(proxy) -> Run | None:
    run = await the_run(proxy)
    return run if run.state in ("completed", "failed", "dead") else None


async def _exit_recorded(proxy) -> Run | None:
    run = await the_run(proxy)
    return run if exits(run) else None
