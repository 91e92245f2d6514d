"""How each attempt ended (docs/restarts.md): its process's exit code or signal,
its held connection's drop, its silence, an operator, the agent, with the last lines of its
log, kept in the run's history on every store and shown by the admin API, ``idemproxy
runs show`` and the console's timeline.

The agents are real processes started by the command hook (stdlib only); the supervisor
runs in the proxy at ``interval_s = 0.2``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from html import unescape
from pathlib import Path

import aiohttp
import pytest

from conftest import proxy_sections, until
from config_files import write_config
from idemproxy.proxy.config import load_settings
from idemproxy.proxy.runs import RunsService
from idemproxy.proxy.runs.endings import TAIL_BYTES, TAIL_LINES, log_tail
from idemproxy.proxy.store import open_store
from idemproxy.proxy.store.model import Run, RunState
from idemproxy.supervisor.hooks import Hooks
from idemproxy.supervisor.loop import Supervisor

ADMIN = {"Authorization": "Bearer test-admin-token"}
# who the test proxies' admin token acts as, in attempt endings and the audit
OPERATOR = "admin:token:" + hashlib.sha256(b"test-admin-token").hexdigest()[:8]
# An agent: notes (epoch, pid) in argv[1], writes 30 numbered lines to its log, then does what
# argv[2] says for its epoch: "crash" (a traceback, exit 1), "sleep" (until killed), "complete".
AGENT = """
import json, os, sys, time, urllib.request
epoch = int(os.environ["IDEM_EPOCH"])
open(sys.argv[1], "a").write(json.dumps({"epoch": epoch, "pid": os.getpid()}) + "\\n")
for i in range(30):
    print(f"epoch {epoch}: step {i} done", flush=True)
plan = dict(item.split("=", 1) for item in sys.argv[2].split(","))
what = plan.get(str(epoch), plan.get("*", "sleep"))
if what == "complete":
    url = os.environ["IDEM_PROXY_URL"] + "/runs/" + os.environ["IDEM_RUN_ID"] + "/complete"
    urllib.request.urlopen(urllib.request.Request(url, method="POST", headers={"Idem-Epoch": str(epoch)}),
                           timeout=10).read()
    sys.exit(0)
if what == "crash":
    raise KeyError("amount")
print("waiting for a lock", flush=True)
time.sleep(600)
"""


@pytest.fixture
def agents(tmp_path):
    """``agents(plan) -> (hook section, started-file)``; the agents still running are
    killed at the end."""
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    files: list[Path] = []

    def make(plan: str) -> tuple[dict, Path]:
        started = tmp_path / f"started-{len(files)}.jsonl"
        files.append(started)
        return {"command": [sys.executable, str(script), str(started), plan], "log_dir": str(tmp_path / "logs"),
                "allow_tenants": ["default"]}, started
    yield make
    for started in files:
        for line in started.read_text().splitlines() if started.exists() else []:
            try:
                os.kill(json.loads(line)["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass


async def _started(path: Path, epoch: int) -> dict | None:
    lines = path.read_text().splitlines() if path.exists() else []
    return next((e for e in map(json.loads, lines) if e["epoch"] == epoch), None)


async def _run(store, run_id: str = "r") -> Run:
    (run,) = await store.runs.find("default", run_id)
    return run


async def _ended(store) -> Run | None:
    run = await _run(store)
    return run if run.state in (RunState.COMPLETED, RunState.FAILED, RunState.DEAD) else None


def _endings(run: Run) -> dict[int, dict]:
    return {e["epoch"]: e for e in run.history if e["event"] == "ended"}


async def _supervised(make_proxy, store_url: str, http, hook: dict, **runs):
    """A proxy with its supervisor, a run ``r`` with the hook, and its first hook-started
    attempt (epoch 1) begun by an operator's restart."""
    proxy = await make_proxy(store_url, supervisor={"enabled": True, "interval_s": 0.2},
                             runs={"timeout_s": 60, "grace_s": 30, "backoff_base_s": 0.1, **runs},
                             hooks__agent=hook)
    async with http.post(f"{proxy.url}/runs/r", json={"hook": "agent", **runs}) as resp:
        assert resp.status == 201, await resp.text()
    async with http.post(f"{proxy.url}/admin/runs/r/restart", headers=ADMIN) as resp:
        assert resp.status == 200 and (await resp.json())["epoch"] == 1
    return proxy


@pytest.mark.slow  # agent processes
async def test_an_exit_with_code_1_is_told_with_its_log_everywhere(make_proxy, store_url, agents, http, tmp_path):
    hook, started = agents("1=crash,2=complete")
    proxy = await _supervised(make_proxy, store_url, http, hook)
    run = await until(lambda: _ended(proxy.store), 15, "crashed, restarted and completed")
    assert (run.state, run.epoch) == ("completed", 2)
    ended = _endings(run)
    assert {e: (ended[e]["how"], ended[e]["detail"]) for e in ended} == {
        0: ("operator", f"restarted by {OPERATOR}"), 1: ("exited", "exited with code 1"),
        2: ("completed", "completed by the agent")}
    crash = ended[1]
    assert (crash["code"], crash["signal"], Path(crash["log"]).name) == (1, None, "default.r.1.log")
    tail = crash["log_tail"].splitlines()
    assert len(tail) == TAIL_LINES and tail[-1] == "KeyError: 'amount'" and "epoch 1: step 29 done" in tail
    assert "epoch 1: step 0 done" not in tail  # the last lines, not the whole log

    # the admin API: how each attempt ended, in the run's JSON
    async with http.get(f"{proxy.url}/admin/runs/r", headers=ADMIN) as resp:
        body = await resp.json()
    assert [(a["epoch"], a["ended"]["how"]) for a in body["attempts"]] == [
        (0, "operator"), (1, "exited"), (2, "completed")]
    assert body["attempts"][1]["ended"]["code"] == 1 and body["attempts"][1]["ended"]["log_tail"] == crash["log_tail"]
    async with http.get(f"{proxy.url}/admin/runs", headers=ADMIN) as resp:  # the listing keeps no log tails
        (listed,) = (await resp.json())["runs"]
    assert listed["attempts"][1]["ended"]["code"] == 1 and "log_tail" not in listed["attempts"][1]["ended"]

    # idemproxy runs show
    shown = await asyncio.to_thread(subprocess.run, [
        sys.executable, "-m", "idemproxy.proxy.cli", "runs", "show", "r", "--store", store_url],
        capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert re.search(r"^1\s+\S+ ago\s+exited\s+exited with code 1$", out, re.M), out
    assert re.search(r"^2\s+\S+ ago\s+completed\s+completed by the agent$", out, re.M), out
    assert "epoch 1, last lines of its log" in out and "  KeyError: 'amount'" in out

    # the console's timeline
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        async with browser.get(f"{proxy.url}/ui/login") as resp:
            form = re.search(r'name="form" value="([0-9a-f]+)"', await resp.text()).group(1)
        async with browser.post(f"{proxy.url}/ui/login", data={"form": form, "token": "test-admin-token"}):
            pass
        async with browser.get(f"{proxy.url}/ui/runs/r") as resp:
            assert resp.status == 200
            page = await resp.text()
    words = " ".join(unescape(re.sub(r"<[^>]+>", " ", page)).split())
    assert "(silent)" not in words
    assert "restarted by the supervisor: epoch 1 exited with code 1" in words
    assert "How it ended: exited with code 1 — the last lines of its log" in words
    assert "KeyError: 'amount'" in unescape(page) and "epoch 1: step 29 done" in page


@pytest.mark.slow  # agent processes, waits out a timeout
async def test_silence_and_a_signal_are_told_apart(make_proxy, store_url, agents, http):
    hook, started = agents("1=sleep,2=sleep,3=complete")
    # silence: timeout_s after the grace that follows each start; a grace long enough that
    # attempt 2 is surely killed within it, on a busy machine too
    proxy = await _supervised(make_proxy, store_url, http, hook, timeout_s=0.5, grace_s=3.0)
    await until(lambda: _started(started, 1), 10, "attempt 1 up")
    second = await until(lambda: _started(started, 2), 10, "attempt 1 silent, attempt 2 up")
    os.kill(second["pid"], signal.SIGKILL)  # within its grace: its death, not its silence, ends it
    run = await until(lambda: _ended(proxy.store), 15, "restarted after the kill and completed")
    ended = _endings(run)
    assert [ended[e]["how"] for e in sorted(ended)] == ["operator", "silent", "killed", "completed"]
    silent, killed = ended[1], ended[2]
    assert silent["detail"].startswith("silent for ") and silent["timeout_s"] == 0.5
    assert silent["silent_s"] >= 0.5 and "no request open, no byte moved" in silent["detail"]
    assert silent["log_tail"].splitlines()[-1] == "waiting for a lock"  # its process still runs
    assert (killed["code"], killed["signal"], killed["detail"]) == (None, "SIGKILL", "killed by SIGKILL")
    assert killed["log_tail"].splitlines()[-1] == "waiting for a lock"


@pytest.fixture
async def lone(store_url, tmp_path):
    """A runs service and a supervisor on the store, driven tick by tick; hook ``agent``
    exits at once (``true``)."""
    sections = proxy_sections("http://127.0.0.1:9", store_url, runs={"hook": "agent"},
                              hooks__agent={"command": ["true"], "log_dir": str(tmp_path / "logs"),
                                            "watch_exit": False})
    settings = load_settings(write_config(tmp_path / "lone.toml", sections), env={})
    store = await open_store(settings)
    service = RunsService(store, settings, Hooks(settings, store))
    yield service, Supervisor(service, settings)
    await service.launcher.aclose()
    await store.aclose()


async def test_a_dropped_held_connection_and_a_death_without_a_hook(lone):
    service, supervisor = lone
    now = time.time()
    await service.store.runs.upsert(Run("default", "held", hook="agent", last_seen=now, started_at=now,
                                        created_at=now, timeout_s=60, grace_s=60))
    attached = await service.attach("default", "held", 0)
    assert await service.lose_attachment("default", "held", 0, attached.attachments, 0.5)
    assert ("held", "restart") in await supervisor.tick()
    run = await _run(service.store, "held")
    assert run.epoch == 1
    assert _endings(run)[0] == {"at": _endings(run)[0]["at"], "epoch": 0, "event": "ended", "how": "dropped",
                                "detail": "its held connection closed and stayed gone for 0.5s", "waited_s": 0.5}

    long_ago = now - 100
    await service.store.runs.upsert(Run("default", "hookless", last_seen=long_ago, started_at=long_ago,
                                        created_at=long_ago, timeout_s=30, grace_s=30))
    assert ("hookless", "dead") in await supervisor.tick()
    run = await _run(service.store, "hookless")
    ending = _endings(run)[0]
    assert (run.state, ending["how"], ending["dead"]) == ("dead", "silent", "silent, and no hook can start it again")
    assert ending["silent_s"] >= 100 and [e["event"] for e in run.history[:2]] == ["ended", "dead"]


async def test_the_agents_own_ends_and_attempts(make_proxy, store_url, http):
    proxy = await make_proxy(store_url)
    async with http.post(f"{proxy.url}/runs/r", json={}) as resp:
        assert resp.status == 201
    async with http.post(f"{proxy.url}/runs/r/attempts") as resp:  # started again by a Kubernetes Job, say
        assert (await resp.json())["epoch"] == 1
    async with http.post(f"{proxy.url}/runs/r/fail", headers={"Idem-Epoch": "1"}) as resp:
        assert resp.status == 200
    ended = _endings(await _run(proxy.store))
    assert {e: (ended[e]["how"], ended[e]["detail"], ended[e].get("by")) for e in ended} == {
        0: ("superseded", "the agent started the next attempt", None), 1: ("failed", "failed by the agent", "agent")}
    async with http.post(f"{proxy.url}/runs/r/complete", headers={"Idem-Epoch": "1"}) as resp:
        assert resp.status == 409  # ended already: nothing more is recorded
    assert len(_endings(await _run(proxy.store))) == 2
    async with http.post(f"{proxy.url}/runs/r2", json={}) as resp:
        assert resp.status == 201
    async with http.post(f"{proxy.url}/admin/runs/r2/complete", headers=ADMIN) as resp:
        ending = (await resp.json())["attempts"][0]["ended"]
    assert (ending["how"], ending["detail"], ending["by"]) == ("completed", f"completed by {OPERATOR}", OPERATOR)


async def test_a_request_of_the_next_epoch_ends_the_attempt_before(make_proxy, store_url, http):
    """An agent started again elsewhere whose first word is a proxied request carrying the
    next Idem-Epoch: the attempt it supersedes is ended, once, in the same store change."""
    proxy = await make_proxy(store_url)
    async with http.post(f"{proxy.url}/runs/r", json={}) as resp:
        assert resp.status == 201
    for _ in range(2):  # the second request of the same attempt raises nothing
        async with http.post(f"{proxy.url}/runs/r/epochs/1/openai/v1/chat/completions",
                             json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                             headers={"Authorization": "Bearer sk-a"}) as resp:
            assert resp.status == 200, await resp.text()
    run = await _run(proxy.store)
    ended = _endings(run)
    assert run.epoch == 1 and list(ended) == [0]
    assert (ended[0]["how"], ended[0]["detail"], ended[0]["by_request"]) == (
        "superseded", "a request of epoch 1 started the next attempt", 1)
    async with http.get(f"{proxy.url}/admin/runs/r", headers=ADMIN) as resp:
        shown = (await resp.json())["attempts"][0]["ended"]
    assert shown["detail"] == "a request of epoch 1 started the next attempt"


def test_a_log_tail_is_its_last_lines_within_its_last_bytes(tmp_path):
    log = tmp_path / "a.log"
    assert log_tail(log) is None and log_tail(None) is None
    log.write_text("")
    assert log_tail(log) is None
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    assert log_tail(log).splitlines() == [f"line {i}" for i in range(80, 100)]
    log.write_bytes(b"x" * 10000 + b"\n" + b"y" * 5000 + b"\nlast \xff\n")
    assert log_tail(log) == "last \ufffd"  # the line cut by the byte bound is left out; bytes decoded
    log.write_bytes(b"z" * 100 + b"\nend\n")
    assert log_tail(log) == "z" * 100 + "\nend"  # a file within the bound is whole
