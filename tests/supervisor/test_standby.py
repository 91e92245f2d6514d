"""Standbys: a command hook's processes started ahead, imported and waiting, handed a run
when the hook fires (``[hooks.NAME] standby = N``), so that a restart skips the agent's
imports (docs/restarts.md).

Real processes on the real client library, a proxy with its supervisor (``interval_s = 1``),
``timeout_s = 60``: a restart within a second comes from the exit itself, and a process
that says ``up`` before the restart was fired was started ahead of it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import proxy_sections, until
from idemproxy.proxy.appkeys import RUNS
from idemproxy.proxy.store.model import Run

pytestmark = pytest.mark.slow  # agent processes, started ahead, killed and restarted

ADMIN = {"Authorization": "Bearer test-admin-token"}
# An agent on the client library: says "up" once imported, then `Run()` (which, in a standby,
# waits for the run), one model call through the proxy, then what argv[2] says for its
# epoch: "sleep" (until killed) or "complete" (the block ends: the run is completed).
AGENT = """
import json, os, sys, time
from idemproxy_client import Run
def say(event, **facts):
    with open(sys.argv[1], "a") as out:
        out.write(json.dumps({"event": event, "pid": os.getpid(), "t": time.time(), **facts}) + "\\n")
say("up", standby=os.environ.get("IDEM_STANDBY"), run=os.environ.get("IDEM_RUN_ID"))
plan = dict(item.split("=", 1) for item in sys.argv[2].split(","))
with Run(heartbeat=False) as run:
    say("assigned", epoch=run.epoch, run=run.run_id, attempt=os.environ["IDEM_ATTEMPT"],
        base=os.environ["IDEM_RUN_BASE"], token=run.token, standby=os.environ.get("IDEM_STANDBY"),
        stdin=os.path.samestat(os.fstat(0), os.stat(os.devnull)))
    with run.client("openai") as llm:
        reply = llm.post("/v1/chat/completions", json={"model": "m", "messages": [
            {"role": "user", "content": "the one step"}]})
    say("called", epoch=run.epoch, replayed=reply.headers.get("idempotent-replayed"))
    if plan.get(str(run.epoch), plan.get("*")) == "sleep":
        time.sleep(600)
"""
# Not on the client library: never says it waits, so it is never handed a run.
PLAIN = """
import json, os, sys, time
with open(sys.argv[1], "a") as out:
    out.write(json.dumps({"event": "up", "pid": os.getpid(), "t": time.time(),
                          "run": os.environ.get("IDEM_RUN_ID")}) + "\\n")
if not os.environ.get("IDEM_RUN_ID"):
    time.sleep(600)
"""


class Agents:
    """What the hook's processes said, from their file."""

    def __init__(self, path: Path):
        self.path = path

    def said(self, event: str) -> list[dict]:
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        return [e for e in map(json.loads, lines) if e["event"] == event]

    async def up(self, count: int) -> list[dict]:
        async def enough():
            found = self.said("up")
            return found if len(found) >= count else None
        return await until(enough, 20, f"{count} processes up")

    async def assigned(self, epoch: int) -> dict:
        async def found():
            return next((e for e in self.said("assigned") if e["epoch"] == epoch), None)
        return await until(found, 20, f"epoch {epoch} assigned")


@pytest.fixture
async def standby_proxy(make_proxy, tmp_path, http):
    """``await standby_proxy(store_url, plan, standby=1) -> (proxy, agents)``: a proxy and its
    supervisor with hook ``agent`` keeping ``standby`` processes of AGENT started ahead, and
    run ``r`` registered with ``timeout_s = 60`` and that hook (not started yet)."""
    async def make(store_url: str, plan: str, standby: int = 1, script: str = AGENT):
        path = tmp_path / f"agent-{standby}.py"
        path.write_text(script)
        agents = Agents(tmp_path / "said.jsonl")
        hook = {"command": [sys.executable, str(path), str(agents.path), plan], "standby": standby,
                "log_dir": str(tmp_path / "logs"), "allow_tenants": ["default"]}
        proxy = await make_proxy(store_url, supervisor={"enabled": True, "interval_s": 1.0},
                                 runs={"timeout_s": 60, "grace_s": 30, "backoff_base_s": 0.2},
                                 hooks__agent=hook)
        async with http.post(f"{proxy.url}/runs/r", json={"hook": "agent"}) as resp:
            assert resp.status == 201
        return proxy, agents
    return make


async def waiting(proxy, count: int = 1) -> None:
    """Until the proxy's supervisor has ``count`` standbys that said they wait for a run."""
    launcher = proxy.app[RUNS].launcher
    await until(lambda: asyncio.sleep(0, launcher.standbys_waiting("agent") >= count), 20,
                f"{count} standbys waiting")


async def restart(http, proxy) -> int:
    async with http.post(f"{proxy.url}/admin/runs/r/restart", headers=ADMIN) as resp:
        assert resp.status == 200
        return (await resp.json())["epoch"]


async def the_run(proxy) -> Run:
    (run,) = await proxy.store.runs.find("default", "r")
    return run


def started(run: Run, epoch: int) -> dict:
    return next(e for e in run.history if e["event"] == "hook-started" and e["epoch"] == epoch)


def restart_at(run: Run, epoch: int) -> float:
    return next(e["at"] for e in run.history if e["event"] in ("restart", "admin-restart") and e["epoch"] == epoch)


def alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


async def test_a_restart_is_served_by_a_standby_started_before_it(standby_proxy, sqlite_url, http, provider,
                                                                   tmp_path):
    proxy, agents = await standby_proxy(sqlite_url, "*=complete")
    (ahead,) = await agents.up(1)
    assert (ahead["standby"], ahead["run"]) == ("1", None)  # no run in its environment
    await waiting(proxy)  # it said `ready` on its channel: Run() is waiting
    fired = time.time()
    assert await restart(http, proxy) == 1
    assigned = await agents.assigned(1)
    run = await until(lambda: _ended(proxy), 20, "the run completed by the standby")
    assert ahead["pid"] == assigned["pid"] == started(run, 1)["pid"] and ahead["t"] < fired
    # started before it said `up`, which was before the restart was asked for (a fixed floor, once
    # 0.3 s, was this machine's import time: a faster phase imported in 0.285 s)
    assert started(run, 1)["standby"] is True
    assert started(run, 1)["started_ahead_s"] >= round(fired - ahead["t"], 3) > 0
    assert (run.state, run.epoch) == ("completed", 1)
    # the facts a spawned hook has; stdin is /dev/null again, the marker is gone
    assert assigned == {**assigned, "run": "r", "attempt": "1", "standby": None, "stdin": True,
                        "base": f"{proxy.url}/runs/r/epochs/1/cap/{assigned['token']}"}
    assert provider.calls["chat"] == 1
    # its log has the attempt's name, as a spawned hook's
    log = Path(started(run, 1)["log"])
    assert log == tmp_path / "logs" / "default.r.1.log" and log.exists()
    # and a replacement was started after it was taken
    replacement = (await agents.up(2))[1]
    assert replacement["pid"] != ahead["pid"] and alive(replacement["pid"])


async def test_a_killed_standby_agent_is_restarted_at_once_by_another_standby(standby_proxy, store_url, http,
                                                                              provider):
    proxy, agents = await standby_proxy(store_url, "1=sleep,2=complete")
    await agents.up(1)
    await waiting(proxy)
    await restart(http, proxy)
    first = await agents.assigned(1)
    await until(lambda: asyncio.sleep(0, [e for e in agents.said("called") if e["epoch"] == 1]), 10, "called")
    second_up = (await agents.up(2))[1]  # the replacement, started after the first was taken
    await waiting(proxy)
    killed = time.time()
    os.kill(first["pid"], signal.SIGKILL)
    second = await agents.assigned(2)
    run = await until(lambda: _ended(proxy), 20, "completed by the second standby")
    assert restart_at(run, 2) - killed < 1.0  # timeout_s is 60
    assert second["pid"] == second_up["pid"] and second_up["t"] < restart_at(run, 2)
    assert started(run, 2)["standby"] is True
    exit_ = next(e for e in run.history if e["event"] == "hook-exit" and e["epoch"] == 1)
    assert (exit_["pid"], exit_["signal"], exit_["code"], exit_["lost"]) == (first["pid"], "SIGKILL", None, True)
    assert (run.state, run.epoch) == ("completed", 2)
    # the second attempt resumed: its model call was answered from the journal
    assert [e["replayed"] for e in agents.said("called")] == ["false", "true"]
    assert provider.calls["chat"] == 1


async def test_with_two_supervisors_exactly_one_standby_takes_each_restart(make_proxy, store_url, tmp_path, http,
                                                                          provider):
    path = tmp_path / "agent.py"
    path.write_text(AGENT)
    agents = Agents(tmp_path / "said.jsonl")
    hook = {"command": [sys.executable, str(path), str(agents.path), "1=sleep,2=complete"], "standby": 1,
            "log_dir": str(tmp_path / "logs"), "allow_tenants": ["default"]}
    replicas = [await make_proxy(store_url, supervisor={"enabled": True, "interval_s": 1.0},
                                 runs={"timeout_s": 60, "grace_s": 30}, hooks__agent=hook) for _ in range(2)]
    async with http.post(f"{replicas[0].url}/runs/r", json={"hook": "agent"}) as resp:
        assert resp.status == 201
    for replica in replicas:  # one standby each
        await waiting(replica)
    await restart(http, replicas[0])
    first = await agents.assigned(1)
    os.kill(first["pid"], signal.SIGKILL)  # both supervisors see the attempt lost; one claims the restart
    await agents.assigned(2)
    run = await until(lambda: _ended(replicas[0]), 20, "completed")
    await asyncio.sleep(1.5)  # time for a second, wrong, assignment to show
    assert [e["epoch"] for e in agents.said("assigned")] == [1, 2]
    assert [e["event"] for e in run.history].count("hook-started") == 2 and run.epoch == 2
    assert provider.calls["chat"] == 1


async def test_an_idle_standby_that_dies_is_replaced(standby_proxy, sqlite_url, http):
    proxy, agents = await standby_proxy(sqlite_url, "*=complete")
    (first,) = await agents.up(1)
    os.kill(first["pid"], signal.SIGKILL)
    replacement = (await agents.up(2))[1]
    assert replacement["pid"] != first["pid"] and alive(replacement["pid"])
    await until(lambda: asyncio.sleep(0, not alive(first["pid"])), 5, "the killed standby reaped")
    await waiting(proxy)
    run = await the_run(proxy)
    assert run.epoch == 0 and not run.history[1:]  # nothing happened to any run
    await restart(http, proxy)
    assert (await agents.assigned(1))["pid"] == replacement["pid"]


async def test_stopping_the_supervisor_ends_idle_standbys_not_assigned_ones(standby_proxy, sqlite_url, http):
    proxy, agents = await standby_proxy(sqlite_url, "*=sleep", standby=2)
    await agents.up(2)
    await waiting(proxy, 2)
    await restart(http, proxy)
    agent = await agents.assigned(1)
    idle = [e["pid"] for e in (await agents.up(3)) if e["pid"] != agent["pid"]]
    assert len(idle) == 2 and all(map(alive, idle))
    await proxy.server.close()  # the app's cleanup stops the supervisor, then the hooks
    assert not any(map(alive, idle))
    try:
        assert alive(agent["pid"])  # an agent at work is not ours to stop
    finally:
        os.kill(agent["pid"], signal.SIGKILL)  # ours to reap: the closed supervisor let it go
        await until(lambda: asyncio.sleep(0, os.waitpid(agent["pid"], os.WNOHANG)[0]), 5, "agent reaped")


async def test_without_standby_each_restart_spawns_the_command(standby_proxy, sqlite_url, http):
    proxy, agents = await standby_proxy(sqlite_url, "*=complete", standby=0)
    await asyncio.sleep(1.0)
    assert agents.said("up") == []  # nothing started ahead
    fired = time.time()
    await restart(http, proxy)
    (up,) = await agents.up(1)
    assert up["t"] > fired and (up["standby"], up["run"]) == (None, "r")  # IDEM_* from its start
    run = await until(lambda: _ended(proxy), 20, "completed")
    assert "standby" not in started(run, 1)


async def test_an_agent_that_does_not_wait_is_never_handed_a_run(standby_proxy, sqlite_url, http):
    proxy, agents = await standby_proxy(sqlite_url, "*=complete", script=PLAIN)
    (plain,) = await agents.up(1)  # started ahead, but it never says it waits
    await asyncio.sleep(1.0)  # time enough to have said it, had it been waiting
    await restart(http, proxy)
    spawned = (await agents.up(2))[1]
    run = await the_run(proxy)
    assert spawned["run"] == "r" and started(run, 1)["pid"] == spawned["pid"] != plain["pid"]
    assert "standby" not in started(run, 1)


async def test_a_command_that_exits_at_once_is_not_started_again_and_again(standby_proxy, sqlite_url, caplog):
    broken = "import json, os, sys, time\n" + PLAIN.split("if not", 1)[0] + "sys.exit(3)\n"
    proxy, agents = await standby_proxy(sqlite_url, "*=complete", script=broken)
    # replaced after 0.5, 1, 2 and 4 s; the fifth death in a row turns standbys off
    starts = await until(lambda: asyncio.sleep(0, len(agents.said("up")) >= 5 and agents.said("up")), 20, "5 starts")
    gaps = [b["t"] - a["t"] for a, b in zip(starts, starts[1:])]
    assert all(wait <= gap < wait + 1.0 for wait, gap in zip([0.5, 1.0, 2.0, 4.0], gaps)), gaps
    await asyncio.sleep(3)
    assert len(agents.said("up")) == 5
    assert "standbys turned off: 5 standbys in a row ended before they said they wait" in caplog.text


async def test_idle_standbys_do_not_outlive_a_supervisor_killed_hard(proxy_process, provider, sqlite_url, tmp_path):
    path = tmp_path / "agent.py"
    path.write_text(AGENT)
    agents = Agents(tmp_path / "said.jsonl")
    sections = proxy_sections(provider.url, sqlite_url, supervisor={"enabled": True},
                              hooks__agent={"command": [sys.executable, str(path), str(agents.path), "*=complete"],
                                            "standby": 2, "log_dir": str(tmp_path / "logs")})
    proxy = proxy_process(sections)
    idle = [e["pid"] for e in await agents.up(2)]
    await asyncio.sleep(1.0)  # past their imports: waiting
    proxy.kill()  # SIGKILL: nothing of ours runs to stop them; their channel's far end closes
    # they are the killed proxy's children, reparented and reaped by whoever adopts them
    await until(lambda: asyncio.sleep(0, not any(map(alive, idle))), 10, "idle standbys gone")
    assert agents.said("assigned") == []


async def _ended(proxy) -> Run | None:
    run = await the_run(proxy)
    return run if run.state in ("completed", "failed", "dead") else None


WAITER = """
import sys
from idemproxy_client import wait_for_assignment
print(wait_for_assignment())
"""


def test_a_standby_let_go_without_a_run_exits_quietly(tmp_path):
    ours, theirs = socket.socketpair()
    env = {**os.environ, "IDEM_STANDBY": "1"}
    env.pop("IDEM_RUN_ID", None)
    with theirs:
        waiter = subprocess.Popen([sys.executable, "-c", WAITER], stdin=theirs, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert ours.recv(64) == b"ready\n"
    ours.close()  # the supervisor went away
    out, err = waiter.communicate(timeout=20)
    assert (waiter.returncode, out, err) == (0, b"", b"")


def test_a_copied_standby_marker_is_refused_clearly():
    env = {**os.environ, "IDEM_STANDBY": "1"}
    env.pop("IDEM_RUN_ID", None)
    done = subprocess.run([sys.executable, "-c", WAITER], stdin=subprocess.DEVNULL, env=env,
                          capture_output=True, text=True, timeout=20)
    assert done.returncode == 1 and "stdin is not a supervisor's standby channel" in done.stderr
