"""idemproxy-client against a real proxy: runs, epochs, keys, heartbeats, SDK clients.

``Run`` is sync httpx and ``AsyncRun`` async httpx; the proxy and the fake provider run on
this test's event loop, so sync client code runs in a worker thread
(``asyncio.to_thread``) while the loop serves it. Restarted agents are real subprocesses.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import subprocess
import sys
import textwrap
import time
import venv
from pathlib import Path

import httpx
import pytest

from idemproxy.proxy.identity import parse_key
from idemproxy_client import (AsyncRun, ProxyUnreachable, Run, RunEnded, RunExists, RunInfo,
                              RunState, Superseded, step_key)
from idemproxy_client.api import RunsAPI
from idemproxy_client.tls import shared_context

REPO = Path(__file__).resolve().parents[2]
CLIENT = REPO / "clients" / "python"
ADMIN = {"Authorization": "Bearer test-admin-token"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "plan the trip"}]}

# An agent as a user writes it: one model call, one tool call with a side effect keyed
# by run.key, then either a crash (os._exit, nothing marked) or a normal end.
AGENT = textwrap.dedent('''
    import json, os, sys
    from idemproxy_client import Run

    mode, run_id = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    with Run(run_id, timeout_s=float(os.environ.get("AGENT_TIMEOUT_S", "30")), grace_s=0.5) as run:
        chat = run.openai().chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "write to alice"}])
        key = run.key("send-email", "alice@example.com")
        with run.client("tools") as tools:
            sent = tools.post("/email", json={"to": "alice@example.com"},
                              headers={"Idempotency-Key": key})
        print(json.dumps({"run_id": run.run_id, "epoch": run.epoch, "key": key,
                          "chat_replayed": chat.headers["Idempotent-Replayed"],
                          "email_replayed": sent.headers["Idempotent-Replayed"],
                          "reply": chat.parse().choices[0].message.content}), flush=True)
        if mode == "crash":
            os._exit(3)  # dies mid-run: no heartbeat, no complete
''')


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("IDEM_", "OPENAI_", "ANTHROPIC_"))}
    return {**env, **extra}


async def run_state(http, proxy_url: str, run_id: str) -> dict:
    async with http.get(f"{proxy_url}/runs/{run_id}") as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def agent_process(script: Path, *args: str, env: dict[str, str]) -> dict:
    proc = await asyncio.create_subprocess_exec(sys.executable, str(script), *args, env=env,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert out, f"agent printed nothing (exit {proc.returncode}): {err.decode()[-2000:]}"
    return {**json.loads(out.decode().splitlines()[-1]), "exit": proc.returncode}


@pytest.fixture
async def proxy(make_proxy, sqlite_url):
    return await make_proxy(sqlite_url)


@pytest.fixture
def agent_script(tmp_path) -> Path:
    path = tmp_path / "agent.py"
    path.write_text(AGENT)
    return path


# -- sync ---------------------------------------------------------------------------------

async def test_sync_run_registers_calls_through_the_proxy_and_completes(proxy, provider, http):
    def agent():
        with Run("trip-1", proxy_url=proxy.url, timeout_s=30, metadata={"user": "ann"}, env={}) as run:
            assert run.epoch == 0 and run.info.state is RunState.RUNNING
            assert run.token and run.base_url == f"{proxy.url}/runs/trip-1/epochs/0/cap/{run.token}"
            assert run.url("openai", "/v1") == f"{proxy.url}/runs/trip-1/epochs/0/cap/{run.token}/openai/v1"
            with run.openai(api_key="sk-test") as llm:
                reply = llm.chat.completions.create(**CHAT)
            return reply.choices[0].message.content

    assert (await asyncio.to_thread(agent)).startswith("reply")
    state = await run_state(http, proxy.url, "trip-1")
    assert state["state"] == "completed" and state["epoch"] == 0
    assert state["metadata"] == {"user": "ann"} and state["timeout_s"] == 30
    assert provider.calls["chat"] == 1


async def test_exception_marks_failed_and_interrupt_leaves_running(proxy, http):
    def raising(run_id: str, exc: BaseException):
        try:
            with Run(run_id, proxy_url=proxy.url, heartbeat=False, env={}):
                raise exc
        except BaseException as caught:  # noqa: BLE001 - the block's own exception comes back
            assert caught is exc

    await asyncio.to_thread(raising, "boom", ValueError("tool broke"))
    await asyncio.to_thread(raising, "ctrl-c", KeyboardInterrupt())
    await asyncio.to_thread(raising, "exit-0", SystemExit(0))
    await asyncio.to_thread(raising, "exit-2", SystemExit(2))
    assert (await run_state(http, proxy.url, "boom"))["state"] == "failed"
    assert (await run_state(http, proxy.url, "ctrl-c"))["state"] == "running"
    assert (await run_state(http, proxy.url, "exit-0"))["state"] == "completed"
    assert (await run_state(http, proxy.url, "exit-2"))["state"] == "running"


async def test_started_again_without_supervisor_takes_a_new_attempt_and_replays(proxy, provider, http):
    """A process started again by something else (systemd, a Job, a person): new epoch,
    the old attempt fenced, its recorded calls replayed under derived keys."""
    def attempt():
        with Run("resumed", proxy_url=proxy.url, finish=False, heartbeat=False, env={}) as run:
            with run.openai() as llm:
                raw = llm.chat.completions.with_raw_response.create(**CHAT)
            return run.epoch, raw.headers["Idempotent-Replayed"], raw.parse().choices[0].message.content

    first, second = await asyncio.to_thread(attempt), await asyncio.to_thread(attempt)
    assert first[:2] == (0, "false") and second[:2] == (1, "true")
    assert first[2] == second[2]
    assert provider.calls["chat"] == 1
    # the first attempt is a zombie now: the proxy refuses its calls before forwarding
    async with http.post(f"{proxy.url}/runs/resumed/epochs/0/openai/v1/chat/completions", json=CHAT) as r:
        assert r.status == 412
    assert (await run_state(http, proxy.url, "resumed"))["epoch"] == 1


async def test_resume_false_refuses_an_existing_run_and_ended_runs_take_no_attempt(proxy):
    def scenario():
        with Run("taken", proxy_url=proxy.url, heartbeat=False, env={}):
            pass  # completes
        with pytest.raises(RunEnded):
            Run("taken", proxy_url=proxy.url, env={}).start()
        with Run("other", proxy_url=proxy.url, heartbeat=False, finish=False, env={}):
            pass
        with pytest.raises(RunExists):
            Run("other", proxy_url=proxy.url, resume=False, env={}).start()

    await asyncio.to_thread(scenario)


@pytest.mark.slow  # agent subprocesses
async def test_restarted_process_continues_the_run_with_the_epoch_it_was_handed(
        proxy, provider, http, agent_script):
    """The supervisor's way: a new attempt, then the agent started with IDEM_* variables."""
    first = await agent_process(agent_script, "crash", "order-7",
                                env=clean_env(IDEM_PROXY_URL=proxy.url))
    assert first["exit"] == 3 and first["epoch"] == 0
    assert (first["chat_replayed"], first["email_replayed"]) == ("false", "false")
    assert (await run_state(http, proxy.url, "order-7"))["state"] == "running"

    async with http.post(f"{proxy.url}/admin/runs/order-7/restart", headers=ADMIN) as resp:
        assert resp.status == 200, await resp.text()
        epoch = (await resp.json())["epoch"]
    assert epoch == 1
    second = await agent_process(agent_script, "finish", env=clean_env(
        IDEM_RUN_ID="order-7", IDEM_EPOCH=str(epoch), IDEM_PROXY_URL=proxy.url))
    assert second["exit"] == 0
    assert (second["run_id"], second["epoch"], second["key"]) == ("order-7", 1, first["key"])
    assert (second["chat_replayed"], second["email_replayed"]) == ("true", "true")
    assert second["reply"] == first["reply"]
    assert provider.calls["chat"] == 1 and provider.calls["tool:email"] == 1
    state = await run_state(http, proxy.url, "order-7")
    assert (state["state"], state["epoch"]) == ("completed", 1)


@pytest.mark.slow  # proxy and agent subprocesses
async def test_supervisor_restarts_a_crashed_agent_which_replays_and_completes(
        proxy_process, provider, http, agent_script, tmp_path):
    """End to end: the agent dies, goes silent, the supervisor's command hook starts it
    again with IDEM_* variables, and the new attempt replays instead of paying twice."""
    logs = tmp_path / "hook-logs"
    server = proxy_process(_sections(provider.url, tmp_path, **{
        "supervisor": {"enabled": True, "interval_s": 0.2},
        "runs": {"hook": "agent", "backoff_base_s": 0.1},
        "hooks.agent": {"command": [sys.executable, str(agent_script), "finish"],
                        "log_dir": str(logs), "allow_tenants": ["default"]}}))
    first = await agent_process(agent_script, "crash", "nightly-1",
                                env=clean_env(IDEM_PROXY_URL=server.url, AGENT_TIMEOUT_S="1"))
    assert first["exit"] == 3
    deadline = time.monotonic() + 30
    while (state := await run_state(http, server.url, "nightly-1"))["state"] != "completed":
        assert time.monotonic() < deadline, f"not restarted and completed: {state}"
        await asyncio.sleep(0.2)
    assert state["epoch"] == 1 and state["restarts"] == 1
    restarted = json.loads((logs / "default.nightly-1.1.log").read_text().splitlines()[-1])
    assert (restarted["epoch"], restarted["key"]) == (1, first["key"])
    assert (restarted["chat_replayed"], restarted["email_replayed"]) == ("true", "true")
    assert provider.calls["chat"] == 1 and provider.calls["tool:email"] == 1


def _sections(provider_url: str, tmp_path: Path, **extra: dict) -> dict[str, dict]:
    from conftest import proxy_sections
    return proxy_sections(provider_url, f"sqlite:///{tmp_path}/supervised.db", **extra)


# -- keys ---------------------------------------------------------------------------------

def test_keys_are_stable_distinct_and_valid_idempotency_keys():
    key = step_key("order-7", "charge", "ord_1", 1999, {"currency": "eur", "items": [1, 2]})
    assert key == step_key("order-7", "charge", "ord_1", 1999, {"items": [1, 2], "currency": "eur"})
    assert key.startswith("charge:")
    assert parse_key([key]) == key  # the proxy accepts it as it is
    others = {step_key("order-8", "charge", "ord_1", 1999, {"currency": "eur", "items": [1, 2]}),
              step_key("order-7", "refund", "ord_1", 1999, {"currency": "eur", "items": [1, 2]}),
              step_key("order-7", "charge", "ord_2", 1999, {"currency": "eur", "items": [1, 2]}),
              step_key("order-7", "charge", "ord_1", "1999", {"currency": "eur", "items": [1, 2]})}
    assert key not in others and len(others) == 4
    assert parse_key([step_key("r", "send e-mail to «ann»" * 20, "x")])  # any step name, still valid
    with pytest.raises(TypeError):
        step_key("r", "charge", object())
    with pytest.raises(ValueError):
        step_key("r", "")


def test_keys_are_the_same_in_another_process():
    code = "from idemproxy_client import step_key; print(step_key('order-7', 'charge', 'ord_1', 3))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=clean_env(PYTHONHASHSEED="random"))
    assert out.stdout.strip() == step_key("order-7", "charge", "ord_1", 3)


async def test_explicit_key_dedupes_a_side_effect_across_attempts(proxy, provider):
    def attempt():
        with Run("mailer", proxy_url=proxy.url, finish=False, heartbeat=False, env={}) as run:
            with run.client("tools") as tools:
                resp = tools.post("/send", json={"to": "bob"},
                                  headers=run.headers(run.key("send", "bob")))
            return run.epoch, resp.headers["Idempotent-Replayed"], resp.json()

    first, second = await asyncio.to_thread(attempt), await asyncio.to_thread(attempt)
    assert (first[0], first[1]) == (0, "false") and (second[0], second[1]) == (1, "true")
    assert first[2] == second[2] and provider.calls["tool:send"] == 1


# -- heartbeats -----------------------------------------------------------------------------

@pytest.mark.slow  # 1 s of work between heartbeats
async def test_background_thread_heartbeats_reach_the_proxy(proxy, http):
    def long_local_work():
        with Run("busy", proxy_url=proxy.url, timeout_s=0.6, env={}) as run:
            started = run.info.last_seen
            time.sleep(1.0)  # work outside the proxy: only heartbeats say we are alive
            with httpx.Client() as client:
                return started, client.get(f"{proxy.url}/runs/busy").json()["last_seen"]

    registered, during = await asyncio.to_thread(long_local_work)
    assert during > registered + 0.5


async def test_superseded_attempt_stops_beating_and_does_not_end_the_run(proxy, http):
    def zombie_and_successor():
        with Run("twice", proxy_url=proxy.url, timeout_s=0.3, env={}) as old:
            with Run("twice", proxy_url=proxy.url, heartbeat=False, finish=False, env={}) as new:
                assert new.epoch == old.epoch + 1
            deadline = time.monotonic() + 5
            while not old.superseded:
                assert time.monotonic() < deadline, "the old attempt never noticed"
                time.sleep(0.05)
            with pytest.raises(Superseded):
                old.heartbeat()
        return old.epoch

    assert await asyncio.to_thread(zombie_and_successor) == 0
    state = await run_state(http, proxy.url, "twice")
    assert (state["state"], state["epoch"]) == ("running", 1)  # the zombie completed nothing


async def test_a_zombie_that_never_noticed_cannot_end_the_run(proxy, http):
    """No heartbeats, so nothing told the old attempt: the proxy refuses its end (412,
    Idem-Epoch), the client raises Superseded, and the new attempt keeps the run."""
    def zombie_finishes_late():
        old = Run("late", proxy_url=proxy.url, heartbeat=False, env={}).start()
        try:
            with Run("late", proxy_url=proxy.url, heartbeat=False, finish=False, env={}) as new:
                assert (old.epoch, new.epoch) == (0, 1)
            assert not old.superseded
            with pytest.raises(Superseded) as refused:
                old.complete()
            assert refused.value.status == 412 and refused.value.slug == "stale-epoch"
            assert old.superseded
            with pytest.raises(Superseded):
                old.heartbeat()
        finally:
            old.close()

    await asyncio.to_thread(zombie_finishes_late)
    state = await run_state(http, proxy.url, "late")
    assert (state["state"], state["epoch"]) == ("running", 1)

    old = await AsyncRun("late-async", proxy_url=proxy.url, heartbeat=False, env={}).start()
    try:
        async with http.post(f"{proxy.url}/runs/late-async/attempts") as resp:
            assert (await resp.json())["epoch"] == 1
        with pytest.raises(Superseded):
            await old.fail()
        with pytest.raises(Superseded):
            await old.heartbeat()
        assert old.superseded
    finally:
        await old.aclose()
    state = await run_state(http, proxy.url, "late-async")
    assert (state["state"], state["epoch"]) == ("running", 1)


# -- async ----------------------------------------------------------------------------------

@pytest.mark.slow  # 1 s of work between heartbeats
async def test_async_run_with_sdk_clients_and_heartbeat_task(proxy, provider, http):
    async with AsyncRun("async-1", proxy_url=proxy.url, timeout_s=0.6, env={}) as run:
        registered = run.info.last_seen
        async with run.openai() as llm, run.anthropic(api_key="sk-ant") as claude:
            chat = await llm.chat.completions.create(**CHAT)
            message = await claude.messages.create(
                model="claude", max_tokens=10, messages=[{"role": "user", "content": "hi"}])
        async with run.client("tools") as tools:
            sent = await tools.post("/notify", headers=run.headers(run.key("notify", 1)))
        await asyncio.sleep(1.0)  # the heartbeat task keeps the run alive meanwhile
        beat = (await run.refresh()).last_seen
    assert chat.choices[0].message.content.startswith("reply")
    assert message.content[0].text.startswith("claude reply")
    assert sent.status_code == 200 and beat > registered + 0.5
    assert (provider.calls["chat"], provider.calls["messages"], provider.calls["tool:notify"]) == (1, 1, 1)
    assert (await run_state(http, proxy.url, "async-1"))["state"] == "completed"


async def test_async_run_fails_on_exception_and_resumes_with_new_epoch(proxy, provider, http):
    with pytest.raises(RuntimeError):
        async with AsyncRun("async-2", proxy_url=proxy.url, heartbeat=False, env={}):
            raise RuntimeError("model said no")
    assert (await run_state(http, proxy.url, "async-2"))["state"] == "failed"

    async with AsyncRun("async-3", proxy_url=proxy.url, heartbeat=False, finish=False, env={}) as run:
        async with run.openai() as llm:
            first = await llm.chat.completions.create(**CHAT)
    async with AsyncRun("async-3", proxy_url=proxy.url, heartbeat=False, env={}) as again:
        assert again.epoch == 1
        async with again.openai() as llm:
            replay = await llm.chat.completions.with_raw_response.create(**CHAT)
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.parse().choices[0].message.content == first.choices[0].message.content
    assert provider.calls["chat"] == 1


async def test_async_run_step_by_step_starts_beats_and_completes(proxy, http):
    run = await AsyncRun("async-steps", proxy_url=proxy.url, timeout_s=30, heartbeat=False,
                         env={}).start()
    try:
        assert (run.epoch, run.info.state) == (0, RunState.RUNNING)
        registered = run.info.last_seen
        await asyncio.sleep(0.05)
        beat = await run.heartbeat()
        assert beat.state is RunState.RUNNING and beat.last_seen > registered
        assert (await run.refresh()).last_seen == beat.last_seen
        done = await run.complete()
        assert done is not None and done.state is RunState.COMPLETED and run.info is done
        assert await run.complete() is None  # marked once; the block's end would do nothing
        with pytest.raises(RunEnded):
            await run.heartbeat()  # an ended run takes no beats
        with pytest.raises(RuntimeError):
            await run.start()  # one start per AsyncRun
    finally:
        await run.aclose()
    assert (await run_state(http, proxy.url, "async-steps"))["state"] == RunState.COMPLETED


async def test_async_superseded_attempt_stops_beating_and_does_not_end_the_run(proxy, http):
    async with AsyncRun("twice-async", proxy_url=proxy.url, timeout_s=0.3, env={}) as old:
        async with AsyncRun("twice-async", proxy_url=proxy.url, heartbeat=False, finish=False,
                            env={}) as new:
            assert new.epoch == old.epoch + 1
        deadline = time.monotonic() + 5
        while not old.superseded:  # the heartbeat task learns it from a refused beat
            assert time.monotonic() < deadline, "the old attempt never noticed"
            await asyncio.sleep(0.05)
        with pytest.raises(Superseded):
            await old.heartbeat()
    state = await run_state(http, proxy.url, "twice-async")
    assert (state["state"], state["epoch"]) == ("running", 1)  # the zombie completed nothing


async def test_aiohttp_session_extra(proxy, provider):
    async with AsyncRun("aio", proxy_url=proxy.url, heartbeat=False, env={}) as run:
        async with run.aiohttp_session("tools") as session:
            async with session.post("ping", headers={"Idempotency-Key": run.key("ping")}) as r:
                assert r.status == 200 and (await r.json())["tool"] == "ping"
    assert provider.calls["tool:ping"] == 1


def test_unreachable_proxy_is_reported(tmp_path):
    import socket
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ProxyUnreachable):
        Run("nobody", proxy_url=f"http://127.0.0.1:{port}", env={}).start()


def test_run_states_are_the_strings_the_proxy_sends():
    info = RunInfo.from_json({"run_id": "r", "state": "dead", "epoch": 2})
    assert info.state is RunState.DEAD and info.state == "dead" and f"{info.state}" == "dead"
    assert info.ended and RunInfo.from_json({"run_id": "r"}).state is RunState.RUNNING
    assert [state for state in RunState if state.ended] == ["completed", "failed", "dead"]
    with pytest.raises(ValueError):
        RunState("paused")


def test_environment_names_the_run_and_the_proxy():
    run = Run(env={"IDEM_RUN_ID": "r-9", "IDEM_EPOCH": "4", "IDEM_PROXY_URL": "http://p:1/",
                   "IDEM_NAMESPACE": "acme"})
    assert (run.run_id, run.epoch, run.proxy_url, run.tenant) == ("r-9", 4, "http://p:1", "acme")
    assert run.headers()["Idem-Epoch"] == "4" and run.headers()["Idem-Tenant"] == "acme"
    other = Run("another", env={"IDEM_RUN_ID": "r-9", "IDEM_EPOCH": "4"})
    with pytest.raises(RuntimeError):
        other.epoch  # not handed to this run: known only once started
    with pytest.raises(ValueError):
        Run("bad id/with slash", env={})


# -- packaging ------------------------------------------------------------------------------

# The server's dependencies and the SDK extras: none may be importable next to the client.
SERVER_ONLY = ("aiohttp", "orjson", "asyncpg", "redis", "uvloop", "prometheus_client", "idemproxy",
               "openai", "anthropic")


@pytest.mark.slow  # builds a wheel into a fresh venv
@pytest.mark.timeout(180)
def test_client_installs_in_a_fresh_venv_without_server_dependencies(tmp_path, proxy_process,
                                                                       sqlite_url):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--quiet", "--wheel-dir", str(wheels), str(CLIENT)], check=True)
    wheel = next(wheels.glob("idemproxy_client-*.whl"))

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = str(env_dir / "bin" / "python")
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # httpx comes from this machine's own install (no index needed): link exactly the
    # distributions the wheel requires, and theirs, into a folder the fresh venv sees,
    # so nothing else is importable there.
    _link_distributions(_requirement_closure(wheel), tmp_path / "httpx-only", site)
    subprocess.run([python, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet", str(wheel)],
                   check=True, env=clean_env(PIP_DISABLE_PIP_VERSION_CHECK="1"))

    show = subprocess.run([python, "-m", "pip", "show", "idemproxy-client"], capture_output=True,
                          text=True, check=True).stdout
    requires = next(line for line in show.splitlines() if line.startswith("Requires:"))
    assert requires.split(":", 1)[1].strip() == "httpx"
    check = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr

    # Against a real proxy, from the fresh venv: register, beat, complete.
    server = proxy_process({"server": {"host": "127.0.0.1", "access_log": False},
                            "store": {"url": sqlite_url}, "supervisor": {"enabled": False}})
    probe = textwrap.dedent(f'''
        import importlib.util, json, sys
        from idemproxy_client import Run
        missing = [m for m in {SERVER_ONLY!r} if importlib.util.find_spec(m) is None]
        with Run("fresh-venv", proxy_url="{server.url}", timeout_s=5) as run:
            beat = run.heartbeat()
            try:
                run.openai()
            except ImportError as exc:
                hint = str(exc)
        print(json.dumps({{"missing": missing, "epoch": run.epoch, "state": run.info.state,
                          "hint": hint,
                          "typed": importlib.util.find_spec("idemproxy_client").submodule_search_locations[0]}}))
    ''')
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True,
                         env=clean_env(), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert sorted(result["missing"]) == sorted(SERVER_ONLY)
    assert (result["epoch"], result["state"]) == (0, "completed")
    assert "pip install 'idemproxy-client[openai]'" in result["hint"]
    assert (Path(result["typed"]) / "py.typed").exists()


def _requirement_closure(wheel: Path) -> list[str]:
    """Names of the distributions the wheel needs on this Python, transitively."""
    import zipfile
    from importlib import metadata

    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        pending = [line.split(":", 1)[1].strip() for line in archive.read(meta).decode().splitlines()
                   if line.startswith("Requires-Dist:")]
    needed: list[str] = []
    while pending:
        req = Requirement(pending.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name.lower() in needed:
            continue
        needed.append(req.name.lower())
        pending += metadata.distribution(req.name).requires or []
    return needed


def _link_distributions(names: list[str], folder: Path, site: Path) -> None:
    from importlib import metadata

    folder.mkdir()
    for name in names:
        dist = metadata.distribution(name)
        root = Path(str(dist.locate_file("")))
        tops = {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}
        for top in tops:
            if (root / top).exists() and not (folder / top).exists():
                (folder / top).symlink_to(root / top)
    (site / "httpx-only.pth").write_text(str(folder) + "\n")


def test_the_clients_of_the_library_share_one_tls_context_unless_told_otherwise():
    """httpx loads its CA bundle for each client (~50 ms of CPU): a restarted agent makes
    three or four before its first call, so they share one context; a caller who chooses
    its own TLS (``verify``, ``cert``, ...) keeps it."""
    run = Run("tls-run", proxy_url="http://127.0.0.1:9", epoch=0)

    def context(client: httpx.Client) -> ssl.SSLContext:
        return client._transport._pool._ssl_context

    with run.client("tools") as a, run.client("search") as b, run.client("mail", verify=False) as own:
        assert context(a) is context(b) is shared_context()
        assert context(own) is not shared_context() and context(own).verify_mode == ssl.CERT_NONE
    api = RunsAPI("http://127.0.0.1:9")
    try:
        assert context(api._client) is shared_context()
    finally:
        api.close()
