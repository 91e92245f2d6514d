"""Held connections: ``POST /runs/{id}/attach`` and ``Run(attach=True)`` (docs/restarts.md).

An agent that no command hook started holds one connection per attempt; when its process
dies the proxy holding it (a real ``idemproxy serve``) waits ``attach_grace_s`` and marks
the attempt lost, and a supervisor on another replica restarts the run at once
(``timeout_s`` is 60 here). A blip the
client reconnects through within the grace changes nothing; a longer one makes the
attempt a zombie, fenced like any other.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from idemproxy.proxy.appkeys import METRICS
from idemproxy.proxy.runs.process import LocalProcess, start_ticks
from idemproxy.proxy.store.model import Run as StoredRun
from conftest import proxy_sections, until
from idemproxy_client import AsyncRun, Attachment, Run, Superseded
from idemproxy_client.process import process_token
from rawhttp import problem
from relay import Relay

GRACE_S = 0.5
RUNS = {"timeout_s": 60, "grace_s": 30, "attach_grace_s": GRACE_S, "attach_keepalive_s": 0.2}
# For the quick tests of the HTTP face and the client: one store (the contract suite runs
# the store's side on all three), a shorter grace.
QUICK_GRACE_S = 0.2
QUICK = {**RUNS, "attach_grace_s": QUICK_GRACE_S, "attach_keepalive_s": 0.1}
# The restarted attempt, started by replica B's hook: says so in argv[1], completes the run.
COMPLETER = textwrap.dedent("""
    import json, os, sys, time, urllib.request
    open(sys.argv[1], "a").write(json.dumps({"epoch": int(os.environ["IDEM_EPOCH"]), "t": time.time()}) + "\\n")
    url = os.environ["IDEM_PROXY_URL"] + "/runs/" + os.environ["IDEM_RUN_ID"] + "/complete"
    urllib.request.urlopen(urllib.request.Request(url, method="POST", headers={"Idem-Epoch": os.environ["IDEM_EPOCH"]}),
                           timeout=10).read()
""")
# The first attempt, started by hand (no hook watches it): holds its connection, then waits.
# With argv[3] "another-host" its Idem-Process names a process on another machine (another boot
# id), as an agent on another host would: the proxy cannot look at it and waits out the grace.
HOLDER = textwrap.dedent("""
    import json, os, sys, time
    from idemproxy_client import Run, attach
    if sys.argv[3] == "another-host":
        attach.process_token = lambda: "0b5e55ed-another-host 4026531836 1 1"
    with Run(sys.argv[1], proxy_url=sys.argv[2], attach=True, hook="agent", timeout_s=60, grace_s=30,
             heartbeat=False, env={}) as run:
        assert run.attachment.wait_attached(10)
        print(json.dumps({"epoch": run.epoch, "pid": os.getpid()}), flush=True)
        time.sleep(600)
""")


@pytest.fixture
async def replicas(make_proxy, proxy_process, provider, store_url, tmp_path):
    """Two proxies on one store: ``holder``, an ``idemproxy serve`` process without a
    supervisor, holds connections; ``watcher``, in this process, runs the supervisor
    (``interval_s = 1``) with the ``agent`` hook (COMPLETER)."""
    script = tmp_path / "completer.py"
    script.write_text(COMPLETER)
    started = tmp_path / "started.jsonl"
    hook = {"command": [sys.executable, str(script), str(started)], "log_dir": str(tmp_path / "logs"),
            "allow_tenants": ["default"]}
    holder = proxy_process(proxy_sections(provider.url, store_url, runs=RUNS, hooks__agent=hook))
    watcher = await make_proxy(store_url, runs=RUNS, hooks__agent=hook,
                               supervisor={"enabled": True, "interval_s": 1.0})
    return holder, watcher, started


async def the_run(proxy, run_id: str) -> StoredRun:
    (run,) = await proxy.store.runs.find("default", run_id)
    return run


def events(run: StoredRun, name: str) -> list[dict]:
    return [e for e in run.history if e["event"] == name]


@pytest.mark.slow  # an agent process, SIGKILLed; a restart through the other replica's hook
@pytest.mark.parametrize("where", ["this-host", "another-host"])
async def test_a_held_connection_dropped_by_a_killed_process_restarts_the_run_on_another_replica(
        replicas, store_url, tmp_path, where):
    holder, watcher, started = replicas
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    agent = await asyncio.create_subprocess_exec(sys.executable, str(script), "held", holder.url, where,
                                                 stdout=asyncio.subprocess.PIPE)
    try:
        up = json.loads(await asyncio.wait_for(agent.stdout.readline(), 20))
        assert up["epoch"] == 0
        killed = time.time()
        os.kill(agent.pid, signal.SIGKILL)
    finally:
        if agent.returncode is None:
            agent.kill()
        await agent.wait()

    async def restarted():
        run = await the_run(watcher, "held")
        return run if run.epoch == 1 else None
    run = await until(restarted, 10, "restarted by the other replica")
    restart_at = next(e["at"] for e in events(run, "restart"))
    (lost,) = events(run, "attachment-lost")
    assert (lost["epoch"], lost["attachment"]) == (0, 1)
    # then at once (postgres, redis: the store rings every supervisor), or at the watcher's
    # next tick (sqlite: one process hears only itself)
    hearing = 1.5 if store_url.startswith("sqlite") else 0.5
    if where == "this-host":  # the holding proxy saw the process exit: no grace
        assert lost["process"] == "exited" and lost["waited_s"] < GRACE_S
        assert restart_at - killed < hearing
    else:  # a process it cannot look at: the whole grace
        assert "process" not in lost and lost["waited_s"] == GRACE_S
        assert GRACE_S <= restart_at - killed < GRACE_S + hearing

    async def completed():
        run = await the_run(watcher, "held")
        return run if run.state == "completed" else None
    run = await until(completed, 10, "the restarted attempt completed")
    assert run.epoch == 1 and json.loads(started.read_text())["epoch"] == 1
    assert watcher.app[METRICS].restarts._value.get() == 1
    figures = {"store": store_url.split(":")[0], "where": where, "grace_s": GRACE_S,
               "kill_to_restart_s": round(restart_at - killed, 4)}
    print(f"\nATTACH FIGURES {json.dumps(figures)}")


@pytest.mark.slow  # waits out the grace, twice
async def test_a_blip_within_the_grace_restarts_nothing_and_a_longer_one_makes_a_fenced_zombie(
        replicas, provider, http):
    holder, watcher, started = replicas
    relay = await Relay(holder.port).up()
    try:
        run = AsyncRun("blip", proxy_url=relay.url, attach=True, hook="agent", timeout_s=60, grace_s=30,
                       heartbeat=False, env={})
        async with run:
            await until(lambda: _async(run.attachment.connections == 1), 5, "attached")
            await relay.cut()  # the link breaks; the client reconnects at once
            await until(lambda: _async(run.attachment.connections == 2), 5, "attached again")
            await asyncio.sleep(GRACE_S + 1.2)  # past the grace and a supervisor tick
            now = await the_run(watcher, "blip")
            assert (now.epoch, now.state, now.lost_epoch) == (0, "running", None)
            assert now.attachments == 2 and not events(now, "attachment-lost")

            await relay.down()  # gone for longer than the grace: taken for dead
            restarted = await until(lambda: _at_epoch(watcher, "blip", 1), 5, "restarted")
            assert events(restarted, "attachment-lost")[0]["epoch"] == 0
            await relay.up()  # back: the old attempt is a zombie now
            await until(lambda: _async(run.attachment.over is not None), 5, "the hold ended")
            assert isinstance(run.attachment.over, Superseded) and run.superseded
            async with http.post(f"{run.base_url}/openai/v1/chat/completions", json={"model": "m"}) as resp:
                assert resp.status == 412  # fenced: nothing reaches the upstream
            assert provider.calls["chat"] == 0
        # the zombie's block ends without marking the run; the new attempt completes it
        final = await until(lambda: _ended(watcher, "blip"), 10, "completed by the new attempt")
        assert (final.state, final.epoch) == ("completed", 1)
    finally:
        await relay.down()


async def test_attach_streams_while_the_attempt_lives_and_ends_quietly(make_proxy, sqlite_url, http):
    proxy = await make_proxy(sqlite_url, runs=QUICK)
    url = f"{proxy.url}/runs/quiet/attach"
    await http.post(f"{proxy.url}/runs/quiet")
    async with http.post(url, headers={"Idem-Epoch": "0"}) as resp:
        assert resp.status == 200 and resp.content_type == "application/x-ndjson"
        first = json.loads(await resp.content.readline())
        assert first == {"attached": 1, "run_id": "quiet", "epoch": 0, "keepalive_s": 0.1,
                         "grace_s": QUICK_GRACE_S}
        assert "alive" in json.loads(await resp.content.readline())  # keep-alive lines
        async with http.post(f"{proxy.url}/runs/quiet/attempts") as new:
            assert (await new.json())["epoch"] == 1
        assert json.loads(await resp.content.readline()) == {"superseded": 1}
        assert await resp.content.read() == b""  # and the stream ends
    async with http.post(url, headers={"Idem-Epoch": "1"}) as resp:
        assert json.loads(await resp.content.readline())["attached"] == 2
        async with http.post(f"{proxy.url}/runs/quiet/complete", headers={"Idem-Epoch": "1"}):
            pass
        assert json.loads(await resp.content.readline()) == {"ended": "completed"}
    await asyncio.sleep(QUICK_GRACE_S + 0.2)
    run = await the_run(proxy, "quiet")
    assert run.lost_epoch is None and not events(run, "attachment-lost")


async def test_attach_and_detach_refusals_are_problems_that_change_nothing(make_proxy, store_url, http):
    proxy = await make_proxy(store_url, runs=RUNS)
    await http.post(f"{proxy.url}/runs/r1/attempts")
    await http.post(f"{proxy.url}/runs/r1/attempts")  # epoch 1
    for path in ("attach", "detach"):
        async with http.post(f"{proxy.url}/runs/r1/{path}") as resp:
            await problem(resp, "invalid-request", 400)  # which attempt?
        async with http.post(f"{proxy.url}/runs/r1/{path}", headers={"Idem-Epoch": "0"}) as resp:
            await problem(resp, "stale-epoch", 412)
        async with http.post(f"{proxy.url}/runs/nobody/{path}", headers={"Idem-Epoch": "0"}) as resp:
            await problem(resp, "not-found", 404)
    for named in ("12", "boot 1 2 x", "boot 1 0 5", "boot 1 1_0 5"):  # not 4 fields, not decimal, pid 0
        async with http.post(f"{proxy.url}/runs/r1/attach", headers={"Idem-Epoch": "1", "Idem-Process": named}) as resp:
            await problem(resp, "invalid-header", 400)
    async with http.post(f"{proxy.url}/runs/r1/detach", headers={"Idem-Epoch": "1"}) as resp:
        assert resp.status == 200 and (await resp.json())["epoch"] == 1
    assert (await the_run(proxy, "r1")).attachments == 1  # only the detach counted
    async with http.post(f"{proxy.url}/runs/r1/complete", headers={"Idem-Epoch": "1"}):
        pass
    async with http.post(f"{proxy.url}/runs/r1/attach", headers={"Idem-Epoch": "1"}) as resp:
        await problem(resp, "run-ended", 409)
    run = await the_run(proxy, "r1")
    assert (run.attachments, run.lost_epoch, run.state) == (1, None, "completed")


async def test_a_proxy_that_shuts_down_ends_its_holds_and_marks_nothing(make_proxy, sqlite_url, http):
    proxy = await make_proxy(sqlite_url, runs={**QUICK, "attach_keepalive_s": 20})
    observer = await make_proxy(sqlite_url, runs=QUICK)
    await http.post(f"{proxy.url}/runs/moving")
    async with http.post(f"{proxy.url}/runs/moving/attach", headers={"Idem-Epoch": "0"}) as resp:
        await resp.content.readline()
        closing = asyncio.create_task(proxy.server.close())
        assert json.loads(await asyncio.wait_for(resp.content.readline(), 5)) == {"closing": True}
        await asyncio.wait_for(closing, 5)  # not held up by the stream
    await asyncio.sleep(QUICK_GRACE_S + 0.2)
    run = await the_run(observer, "moving")  # the client reconnects elsewhere; nothing is lost
    assert (run.lost_epoch, run.state) == (None, "running")


async def test_a_block_that_ends_normally_lets_its_connection_go_and_one_that_raises_does_not(
        make_proxy, sqlite_url):
    proxy = await make_proxy(sqlite_url, runs=QUICK)

    def hand_on(run_id: str, fail: bool) -> None:  # finish=False: another process goes on with the run
        with Run(run_id, proxy_url=proxy.url, attach=True, finish=False, heartbeat=False, env={}) as run:
            assert run.attachment.wait_attached(5)
            if fail:
                raise RuntimeError("the work broke; nothing marked the run")

    await asyncio.to_thread(hand_on, "handed-on", False)
    with pytest.raises(RuntimeError):
        await asyncio.to_thread(hand_on, "broken", True)
    await asyncio.sleep(QUICK_GRACE_S + 0.3)
    handed_on, broken = await the_run(proxy, "handed-on"), await the_run(proxy, "broken")
    assert (handed_on.lost_epoch, handed_on.attachments) == (None, 2)  # let go on purpose
    assert (broken.lost_epoch, broken.attachments) == (0, 1)  # dropped like a crash: restart it


async def test_a_process_on_this_host_is_seen_to_exit_and_one_it_cannot_see_is_not():
    boot, namespace, pid, start = process_token().split()
    me = LocalProcess.from_header(process_token())
    assert me == LocalProcess(os.getpid(), int(start)) and not await me.exits_within(0.05)
    assert await LocalProcess(os.getpid(), int(start) + 1).exits_within(5)  # the pid is someone else's now
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        named = LocalProcess.from_header(f"{boot} {namespace} {child.pid} {start_ticks(child.pid)}")
        assert named is not None and not await named.exits_within(0.05)
        child.kill()  # a zombie until reaped: exited all the same
        began = time.monotonic()
        assert await named.exits_within(5) and time.monotonic() - began < 1
    finally:
        child.kill()
        child.wait()
    assert await named.exits_within(5)  # reaped: its pid is nobody's
    # what this proxy cannot see as named is not looked at (the grace decides)
    assert LocalProcess.from_header(f"{boot} {namespace} {child.pid} {start_ticks(os.getpid())}") is None
    assert LocalProcess.from_header(f"{boot} {namespace} {pid} {int(start) + 1}") is None  # another start
    assert LocalProcess.from_header(f"another-boot {namespace} {pid} {start}") is None  # another host
    assert LocalProcess.from_header(f"{boot} 1 {pid} {start}") is None  # another PID namespace
    assert LocalProcess.from_header(None) is None


def test_a_forked_child_names_itself_not_its_parent():
    # in a process of its own: this one has threads, and fork() wants none
    script = textwrap.dedent("""
        import os
        from idemproxy_client.process import process_token
        parent = process_token()  # cached here
        reader, writer = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(writer, process_token().encode())
            os._exit(0)
        os.close(writer)
        child = os.read(reader, 200).decode()
        os.waitpid(pid, 0)
        print(os.getpid(), pid, parent, "|", child)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=True)
    parent_pid, child_pid, rest = out.stdout.split(maxsplit=2)
    parent, child = rest.split(" | ")
    assert parent.split()[2] == parent_pid and child.split()[2] == child_pid  # not the parent's, alive


def test_an_attachment_takes_its_attempt_from_the_hook_environment():
    env = {"IDEM_RUN_ID": "r-7", "IDEM_EPOCH": "3", "IDEM_PROXY_URL": "http://proxy:8787/",
           "IDEM_NAMESPACE": "team-a"}
    held = Attachment.from_env(env)
    assert (held.run_id, held.epoch, held.proxy_url, held.tenant) == ("r-7", 3, "http://proxy:8787", "team-a")
    assert Attachment.from_env({**env, "IDEM_NAMESPACE": "default"}).tenant is None
    with pytest.raises(ValueError):
        Attachment.from_env({"IDEM_PROXY_URL": "http://proxy:8787"})


async def _async(value):
    return value


async def _at_epoch(proxy, run_id: str, epoch: int) -> StoredRun | None:
    run = await the_run(proxy, run_id)
    return run if run.epoch >= epoch else None


async def _ended(proxy, run_id: str) -> StoredRun | None:
    run = await the_run(proxy, run_id)
    return run if run.state in ("completed", "failed", "dead") else None
