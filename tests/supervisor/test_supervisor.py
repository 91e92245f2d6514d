"""The supervisor: silent runs are restarted once, fenced, backed off, buried; live ones are not.

The hooks here exit at once, so they say ``watch_exit = false``: silence alone restarts
their runs. Restarts on an agent's exit are tested in test_exits.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from conftest import proxy_sections
from config_files import write_config
from idemproxy.proxy.appkeys import METRICS
from idemproxy.proxy.store import open_store
from idemproxy.proxy.config import load_settings
from idemproxy.proxy.store.model import Run
from idemproxy.supervisor.hooks import Hooks
from idemproxy.proxy.runs import RunsService
from idemproxy.supervisor.loop import Supervisor

PROBLEM = "https://idemproxy.dev/problems/"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "work"}]}

# A restarted agent that says it is alive, then completes its run (stdlib only: starts fast).
COMPLETER = """
import json, os, sys, urllib.request
open(sys.argv[1], "a").write(json.dumps({k: v for k, v in os.environ.items() if k.startswith("IDEM_")}) + "\\n")
url = os.environ["IDEM_PROXY_URL"] + "/runs/" + os.environ["IDEM_RUN_ID"] + "/complete"
urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=10).read()
"""
# Writes one line per firing (run id, epoch, event) to argv[1], then exits with argv[2].
TALLY = """
import os, sys
open(sys.argv[1], "a").write(" ".join(os.environ[k] for k in ("IDEM_RUN_ID", "IDEM_EPOCH", "IDEM_EVENT")) + "\\n")
sys.exit(int(sys.argv[2]))
"""


def _script(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    return str(path)


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


@pytest.fixture
async def supervised(make_proxy):
    """``await supervised(store_url, **sections)``: a proxy with its supervisor in-process."""
    async def make(store_url: str, **sections):
        sections.setdefault("supervisor", {"enabled": True, "interval_s": 0.1})
        return await make_proxy(store_url, **sections)
    return make


async def _run(proxy, run_id: str) -> Run:
    (run,) = await proxy.store.runs.find("default", run_id)
    return run


async def _until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {timeout}s: {what}")


@pytest.mark.slow  # waits out timeouts and a 1 s zombie window
async def test_silent_run_is_restarted_once_and_its_zombie_fenced(supervised, store_url, provider, http,
                                                                  tmp_path):
    seen = tmp_path / "restarted.jsonl"
    proxy = await supervised(store_url, runs={"timeout_s": 0.5, "grace_s": 0.2, "hook": "agent"},
                             hooks__agent={"command": [sys.executable, _script(tmp_path, "c", COMPLETER),
                                                       str(seen)], "log_dir": str(tmp_path / "logs"),
                                           "allow_tenants": ["default"]})
    zombie = f"{proxy.url}/runs/quiet/epochs/0/openai/v1/chat/completions"
    async with http.post(zombie, json=CHAT) as resp:
        assert resp.status == 200
    # the agent goes quiet; the supervisor restarts it, and the new attempt completes the run
    run = await _until(lambda: _ended(proxy, "quiet"), 10, "run restarted and completed")
    assert (run.state, run.epoch, run.restarts) == ("completed", 1, 1)
    (env,) = [json.loads(line) for line in _lines(seen)]
    assert env["IDEM_EPOCH"] == "1" and env["IDEM_ATTEMPT"] == "1"
    assert env["IDEM_RUN_BASE"] == f"{proxy.url}/runs/quiet/epochs/1/cap/{env['IDEM_RUN_TOKEN']}"
    assert [e["event"] for e in run.history if e["event"] == "restart"] == ["restart"]

    # the old attempt wakes up: refused before anything reaches the upstream
    async with http.post(zombie, json={**CHAT, "messages": [{"role": "user", "content": "late"}]}) as resp:
        assert resp.status == 412
        assert (await resp.json(content_type=None))["type"] == PROBLEM + "stale-epoch"
    assert provider.calls["chat"] == 1
    await asyncio.sleep(1.0)
    assert (await _run(proxy, "quiet")).restarts == 1  # ended: never restarted again
    assert proxy.app[METRICS].restarts._value.get() == 1


async def _ended(proxy, run_id: str) -> Run | None:
    runs = await proxy.store.runs.find("default", run_id)
    if runs and runs[0].state in ("completed", "failed", "dead"):
        return runs[0]
    return None


async def test_two_supervisors_restart_each_silent_run_exactly_once(store_url, tmp_path):
    fired = tmp_path / "fired.txt"
    sections = proxy_sections("http://127.0.0.1:9", store_url, supervisor={"interval_s": 0.05},
                              runs={"hook": "agent"}, hooks__agent={
                                  "command": [sys.executable, _script(tmp_path, "t", TALLY), str(fired), "0"],
                                  "log_dir": str(tmp_path / "logs"), "watch_exit": False})
    settings = load_settings(write_config(tmp_path / "two.toml", sections), env={})
    stores = [await open_store(settings) for _ in range(2)]
    supervisors = [Supervisor(RunsService(s, settings, Hooks(settings, s)), settings) for s in stores]
    try:
        long_ago = time.time() - 100
        ids = [f"silent-{i}" for i in range(20)]
        for run_id in ids:
            await stores[0].runs.upsert(Run("default", run_id, last_seen=long_ago, started_at=long_ago,
                                           created_at=long_ago, timeout_s=30, grace_s=30, hook="agent"))
        for _ in range(5):  # both tick at once, over and over, an interval apart (as Supervisor.run)
            await asyncio.gather(*(s.tick() for s in supervisors))
            await asyncio.sleep(settings.supervisor.interval_s)
        for s in supervisors:
            await s.runs.launcher.wait_idle()
        runs = {r.run_id: r for r in await stores[1].runs.list()}
        assert all((runs[i].epoch, runs[i].restarts, runs[i].state) == (1, 1, "restarting") for i in ids)
        assert sorted(_lines(fired)) == sorted(f"{i} 1 restart" for i in ids)  # one hook each
        assert all(sum(e["event"] == "restart" for e in runs[i].history) == 1 for i in ids)
    finally:
        for s, store in zip(supervisors, stores):
            await s.runs.launcher.aclose()
            await store.aclose()


@pytest.mark.slow  # restarts until max_restarts, with timeouts between
async def test_a_run_that_crashes_every_time_ends_dead(supervised, store_url, http, tmp_path):
    fired, buried = tmp_path / "fired.txt", tmp_path / "dead.txt"
    tally = _script(tmp_path, "t", TALLY)
    proxy = await supervised(
        store_url, runs={"backoff_base_s": 0.2, "on_dead": "pager", "restart_window_s": 60},
        hooks__crasher={"command": [sys.executable, tally, str(fired), "3"], "log_dir": str(tmp_path / "logs"),
                        "allow_tenants": ["default"], "watch_exit": False},
        hooks__pager={"command": [sys.executable, tally, str(buried), "0"], "log_dir": str(tmp_path / "logs")})
    status = (await http.post(f"{proxy.url}/runs/doomed", json={
        "hook": "crasher", "max_restarts": 3, "timeout_s": 0.3, "grace_s": 0.3})).status
    assert status == 201
    run = await _until(lambda: _ended(proxy, "doomed"), 15, "run dead")
    assert (run.state, run.epoch, run.restarts) == ("dead", 3, 3)
    await _until(lambda: _async(_lines(buried)), 5, "on_dead hook fired")  # its line, not just its file
    assert _lines(buried) == ["doomed 3 dead"]
    assert _lines(fired) == ["doomed 1 restart", "doomed 2 restart", "doomed 3 restart"]

    # restarts back off exponentially: silence (0.3s) plus 0.2s, then plus 0.4s
    restarts = [e["at"] for e in run.history if e["event"] == "restart"]
    gaps = [b - a for a, b in zip(restarts, restarts[1:])]
    assert gaps[0] >= 0.3 + 0.2 - 0.01 and gaps[1] >= 0.3 + 0.4 - 0.01, gaps
    await asyncio.sleep(1.0)
    run = await _run(proxy, "doomed")
    assert run.restarts == 3 and len(_lines(fired)) == 3  # dead stays dead
    assert [e["code"] for e in run.history if e["event"] == "hook-exit" and e["hook"] == "crasher"] == [3, 3, 3]
    assert proxy.app[METRICS].restarts._value.get() == 3
    text = await (await http.get(f"{proxy.url}/metrics")).text()
    assert 'idemproxy_runs{state="dead"} 1.0' in text


async def _async(value):
    return value


async def test_a_hookless_silent_run_is_dead_at_once(supervised, store_url, http, tmp_path):
    buried = tmp_path / "dead.txt"
    proxy = await supervised(store_url, runs={"timeout_s": 0.3, "grace_s": 0.1, "on_dead": "pager"},
                             hooks__pager={"command": [sys.executable, _script(tmp_path, "t", TALLY),
                                                       str(buried), "0"], "log_dir": str(tmp_path / "logs"),
                                           "allow_tenants": ["default"]})  # its runs may page someone
    async with http.post(f"{proxy.url}/runs/orphan/epochs/0/openai/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200
    run = await _until(lambda: _ended(proxy, "orphan"), 10, "run dead")
    assert (run.state, run.epoch, run.restarts) == ("dead", 0, 0)  # nothing could start it again
    await _until(lambda: _async(_lines(buried)), 5, "on_dead hook fired")  # its line, not just its file
    assert _lines(buried) == ["orphan 0 dead"]


@pytest.mark.slow  # watches 1 s of supervisor ticks
async def test_completed_and_failed_runs_are_never_restarted(supervised, store_url, http, tmp_path):
    fired = tmp_path / "fired.txt"
    proxy = await supervised(store_url, runs={"timeout_s": 0.2, "grace_s": 0.1, "hook": "agent"},
                             hooks__agent={"command": [sys.executable, _script(tmp_path, "t", TALLY),
                                                       str(fired), "0"], "log_dir": str(tmp_path / "logs"),
                                           "allow_tenants": ["default"], "watch_exit": False})
    for run_id, end in (("finished", "complete"), ("gave-up", "fail")):
        await http.post(f"{proxy.url}/runs/{run_id}")
        assert (await http.post(f"{proxy.url}/runs/{run_id}/{end}")).status == 200
    await http.post(f"{proxy.url}/runs/control")  # a silent run that is restarted, for contrast
    await _until(lambda: _async(fired.exists()), 10, "control run restarted")
    await asyncio.sleep(1.0)  # many supervisor ticks, each long past timeout and grace
    assert [line.split()[0] for line in _lines(fired)] == ["control"]
    for run_id, state in (("finished", "completed"), ("gave-up", "failed")):
        run = await _run(proxy, run_id)
        assert (run.state, run.epoch, run.restarts) == (state, 0, 0)


@pytest.mark.slow  # a stream several run timeouts long
async def test_a_stream_keeps_its_run_alive_until_its_client_leaves(supervised, store_url, http, tmp_path):
    fired = tmp_path / "fired.txt"
    proxy = await supervised(store_url, runs={"timeout_s": 1.5, "grace_s": 0.2, "hook": "agent"},
                             hooks__agent={"command": [sys.executable, _script(tmp_path, "t", TALLY),
                                                       str(fired), "0"], "log_dir": str(tmp_path / "logs"),
                                           "allow_tenants": ["default"], "watch_exit": False},
                             server={"shutdown_timeout": 1})
    url = f"{proxy.url}/runs/streamer/epochs/0/openai/v1/chat/completions"
    body = {**CHAT, "stream": True}

    # 4 seconds of bytes, a chunk every 0.1s: longer than timeout_s, but never silent
    started = time.monotonic()
    async with http.post(url, json=body, headers={"X-Fake-Chunks": "40", "X-Fake-Chunk-Delay": "0.1"}) as resp:
        assert resp.status == 200
        await resp.read()
    assert time.monotonic() - started > 3.5
    run = await _run(proxy, "streamer")
    assert (run.epoch, run.restarts) == (0, 0) and not fired.exists()

    # a stream that stalls: one chunk, then 5 s of nothing. While its client waits, the run is
    # alive (a request open through the proxy keeps its run alive); once the client leaves in the
    # stall, silence counts, and the run is restarted before the next chunk could come.
    body["messages"] = [{"role": "user", "content": "stall"}]
    async with http.post(url, json=body, headers={"X-Fake-Chunks": "3", "X-Fake-Chunk-Delay": "5"}) as resp:
        await resp.content.readany()
        arrived_at = time.time()
        await asyncio.sleep(2.6)  # timeout_s, a heartbeat flush and a tick
        assert (await _run(proxy, "streamer")).restarts == 0
        resp.close()
    left_at = time.time()
    run = await _until(lambda: _restarted(proxy, "streamer"), 4, "restart once the client left")
    restart_at = next(e["at"] for e in run.history if e["event"] == "restart")
    assert restart_at - left_at < 2.7 and restart_at - arrived_at < 5.0, (restart_at - left_at)
    assert run.epoch == 1


async def _restarted(proxy, run_id: str) -> Run | None:
    run = await _run(proxy, run_id)
    return run if run.restarts else None


@pytest.mark.slow  # idemproxy supervise as a subprocess
async def test_supervise_command_restarts_alone_and_stops_on_sigterm(store_url, tmp_path):
    fired = tmp_path / "fired.txt"
    sections = proxy_sections("http://127.0.0.1:9", store_url, supervisor={"interval_s": 0.1},
                              runs={"hook": "agent"}, hooks__agent={
                                  "command": [sys.executable, _script(tmp_path, "t", TALLY), str(fired), "0"],
                                  "log_dir": str(tmp_path / "logs"), "watch_exit": False})
    config = write_config(tmp_path / "supervise.toml", sections)
    # the configuration loads and the store answers; migrate makes its schema (check never would)
    check = await asyncio.create_subprocess_exec(sys.executable, "-m", "idemproxy.proxy.cli", "migrate",
                                                 "--config", str(config), stdout=asyncio.subprocess.PIPE,
                                                 stderr=asyncio.subprocess.PIPE)
    out, err = await check.communicate()
    assert check.returncode == 0, err.decode()

    settings = load_settings(config, env={})
    store = await open_store(settings)
    try:
        long_ago = time.time() - 100
        await store.runs.upsert(Run("default", "lonely", last_seen=long_ago, started_at=long_ago,
                                   created_at=long_ago, timeout_s=30, grace_s=30, hook="agent"))
        log = open(tmp_path / "supervise.log", "wb")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "idemproxy.proxy.cli", "supervise", "--config", str(config),
            stdout=log, stderr=log, start_new_session=True)
        try:
            await _until(lambda: _async(fired.exists()), 15, "supervise restarted the run")
            assert _lines(fired) == ["lonely 1 restart"]
            await _until(lambda: _exit_recorded(store), 5, "hook exit recorded by supervise")
            os.kill(proc.pid, signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 10) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            log.close()
        assert "supervisor stopped" in (tmp_path / "supervise.log").read_text()
    finally:
        await store.aclose()


async def _exit_recorded(store) -> bool:
    (run,) = await store.runs.find("default", "lonely")
    return any(e["event"] == "hook-exit" for e in run.history)


@pytest.mark.slow  # waits out several run timeouts
async def test_a_fenced_zombie_does_not_keep_its_run_alive(supervised, store_url, provider, http, tmp_path):
    fired = tmp_path / "fired.txt"
    # timeout_s above the heartbeat flush period (1s), so steady traffic always looks alive
    proxy = await supervised(store_url, runs={"timeout_s": 1.5, "grace_s": 0.2, "hook": "agent",
                                              "backoff_base_s": 0.1},
                             hooks__agent={"command": [sys.executable, _script(tmp_path, "t", TALLY),
                                                       str(fired), "0"], "log_dir": str(tmp_path / "logs"),
                                           "allow_tenants": ["default"], "watch_exit": False})
    zombie = f"{proxy.url}/runs/haunted/epochs/0/openai/v1/chat/completions"
    async with http.post(zombie, json=CHAT) as resp:
        assert resp.status == 200
    await _until(lambda: _restarted(proxy, "haunted"), 5, "first restart")
    # the new attempt never shows up (its hook exits at once); the old one keeps calling,
    # refused each time: that is no sign of life, so the run is restarted again
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (await _run(proxy, "haunted")).restarts < 2:
        async with http.post(zombie, json=CHAT) as resp:
            assert resp.status == 412
        await asyncio.sleep(0.05)
    assert (await _run(proxy, "haunted")).restarts >= 2
    assert provider.calls["chat"] == 1


@pytest.fixture
async def lone_supervisor(store_url, tmp_path):
    """``await lone_supervisor(**runs_section) -> (supervisor, store)``: a Supervisor on its own
    store, driven tick by tick with made-up times; its hook ``agent`` exits at once."""
    made = []

    async def make(**runs):
        sections = proxy_sections("http://127.0.0.1:9", store_url, runs={"hook": "agent", **runs},
                                  hooks__agent={"command": ["true"], "log_dir": str(tmp_path / "logs"),
                                                "watch_exit": False})
        settings = load_settings(write_config(tmp_path / "lone.toml", sections), env={})
        store = await open_store(settings)
        made.append(Supervisor(RunsService(store, settings, Hooks(settings, store)), settings))
        return made[-1], store

    yield make
    for supervisor in made:
        await supervisor.runs.launcher.wait_idle()
        await supervisor.runs.launcher.aclose()
        await supervisor.store.aclose()


async def test_max_restarts_holds_beyond_what_the_history_keeps(lone_supervisor):
    # 20 restarts, each with its backoff and hook events: far more than the history's 50
    supervisor, store = await lone_supervisor(restart_window_s=10_000, backoff_base_s=1, backoff_max_s=1)
    now = time.time()
    await store.runs.upsert(Run("default", "flaky", last_seen=now, started_at=now, created_at=now,
                               timeout_s=1, grace_s=1, max_restarts=20, hook="agent"))
    actions = []
    for _ in range(100):  # each tick 10s later: silent every time, backoff (1s) always over
        now += 10
        actions += [action for _, action in await supervisor.tick(now)]
        await supervisor.runs.launcher.wait_idle()  # its hook's outcome recorded: the next test says why
        if "dead" in actions:
            break
    (run,) = await store.runs.find("default", "flaky")
    assert (run.state, run.restarts, run.epoch) == ("dead", 20, 20)
    assert actions.count("restart") == 20 and actions[-1] == "dead"
    assert len(run.restart_times) == 20
    # the history alone could not have counted them: most restart events fell out of it
    assert sum(e["event"] == "restart" for e in run.history) < 20


async def test_restarts_outside_the_window_are_forgotten(lone_supervisor):
    supervisor, store = await lone_supervisor(restart_window_s=100, backoff_base_s=1)
    now = time.time()
    await store.runs.upsert(Run("default", "slow-flaky", last_seen=now, started_at=now, created_at=now,
                               timeout_s=1, grace_s=1, max_restarts=2, hook="agent"))
    for _ in range(5):  # a crash every 1000s: never 2 within 100s, so never dead, never backed off
        now += 1000
        assert await supervisor.tick(now) == [("slow-flaky", "restart")]
        # the hook's outcome is recorded apart, holding the run's row a moment: a tick skips a
        # row another writer holds (a replica's claim must never wait), so wait for it here
        await supervisor.runs.launcher.wait_idle()
    (run,) = await store.runs.find("default", "slow-flaky")
    assert (run.state, run.restarts, run.restart_times) == ("restarting", 5, [now])
    # an operator's restart is deliberate: it does not count towards max_restarts
    run = await supervisor.runs.restart(run, now=now + 1)
    assert (run.restarts, run.restart_times) == (6, [now])


async def test_a_sqlite_journal_from_before_restart_times_is_upgraded(sqlite_url, tmp_path):
    import sqlite3

    from idemproxy.proxy.store.sqlite import schema as sqlite_store

    path = sqlite_url.removeprefix("sqlite:///")
    with contextlib.closing(sqlite3.connect(path)) as old:  # version 1: runs without restart_times
        # (and a journal without replays by epoch, version 4's, or evidence, version 6's)
        old.executescript(sqlite_store.SCHEMA.replace(", restart_times BLOB", "").replace(
            ", lost_epoch INTEGER, attachments INTEGER NOT NULL DEFAULT 0", "").replace(", replayed BLOB", "")
            .replace(", evidence BLOB", "")
            .replace(f"\n    claimed_until REAL NOT NULL DEFAULT 0, due_at REAL GENERATED ALWAYS AS "
                     f"({sqlite_store.DUE_AT}) VIRTUAL,", "")  # version 8's
            .replace("CREATE INDEX IF NOT EXISTS runs_due ON runs (due_at) WHERE due_at IS NOT NULL;", "")
            + "PRAGMA user_version=1;")
        old.execute("INSERT INTO journal (kid, tenant, run, epoch, upstream, key, fingerprint, namespace, state, "
                    "status, created_at, expires_at, replays) VALUES "
                    "('k1', 't', 'old', 2, 'tools', 'key:a', 'fp', 'default', 'complete', 200, 1, 9e9, 1)")
        old.execute("INSERT INTO runs (tenant, run_id, state, epoch, last_seen, started_at, timeout_s, "
                    "grace_s, max_restarts, created_at) "
                    "VALUES ('default', 'old', 'running', 2, 1, 1, 60, 30, 5, 1)")
        old.commit()
    config = write_config(tmp_path / "up.toml", proxy_sections("http://127.0.0.1:9", sqlite_url))
    settings = load_settings(config, env={})
    store = await open_store(settings)
    try:
        (run,) = await store.runs.find("default", "old")
        assert (run.epoch, run.restart_times) == (2, [])
        run = await store.runs.new_attempt("default", "old", 2, 50.0, "restart", True, window_s=100)
        assert run.restart_times == [50.0]
        await store.journal.count_replays({"k1": 2})
        (entry,) = await store.journal.entries("default", "old")
        assert (entry.replays, entry.replayed[3][0]) == (3, 2)
        assert (await store.journal.get("k1")).evidence is None and await store.journal.count_quarantined() == 0
    finally:
        await store.aclose()
    store = await open_store(settings)  # opened again: nothing left to upgrade, nothing lost
    try:
        (run,) = await store.runs.find("default", "old")
        assert (run.epoch, run.restart_times) == (3, [50.0])
    finally:
        await store.aclose()
    with contextlib.closing(sqlite3.connect(path)) as upgraded:
        assert upgraded.execute("PRAGMA user_version").fetchone()[0] == sqlite_store.SCHEMA_VERSION
