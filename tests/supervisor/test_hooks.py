"""Hooks: detached commands with a log file per attempt, and signed, retried HTTP POSTs."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import sys
import time

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from conftest import proxy_sections
from config_files import write_config
from idemproxy.proxy.store import open_store
from idemproxy.proxy.config import load_settings
from idemproxy.proxy.identity import TenantResolver, tenant_secret
from idemproxy.proxy.store.model import Run
from idemproxy.supervisor.hooks import Hooks

# Writes its environment, session and pid to argv[1], talks on both streams, exits 7.
REPORTER = """
import json, os, sys
json.dump({"env": {k: v for k, v in os.environ.items() if k.startswith("IDEM")},
           "pid": os.getpid(), "sid": os.getsid(0), "stdin": sys.stdin.read()}, open(sys.argv[1], "w"))
print("to stdout", flush=True)
print("to stderr", file=sys.stderr, flush=True)
sys.exit(7)
"""


@pytest.fixture
async def hooks_on(tmp_path, sqlite_url):
    """``await hooks_on(**hook_sections) -> (hooks, store)`` with a run ``r1`` at epoch 3."""
    made = []

    async def make(**hooks):
        sections = proxy_sections("http://127.0.0.1:9", sqlite_url,
                                  **{f"hooks.{name}": body for name, body in hooks.items()})
        sections["supervisor"]["proxy_url"] = "http://proxy.test:8787"  # what hooks are told
        settings = load_settings(write_config(tmp_path / "hooks.toml", sections), env={})
        store = await open_store(settings)
        now = time.time()
        await store.runs.upsert(Run("default", "r1", epoch=3, restarts=2, last_seen=now,
                                   started_at=now, created_at=now))
        made.append((Hooks(settings, store), store))
        return made[-1]

    yield make
    for hooks, store in made:
        await hooks.aclose()
        await store.aclose()


def _call(event: str = "restart") -> tuple[str, Run]:
    """(event, run) for ``Hooks.fire``: run r1 at epoch 3 after 2 restarts."""
    return event, Run("default", "r1", epoch=3, restarts=2)


async def _history(store) -> list[dict]:
    return (await store.runs.find("default", "r1"))[0].history


async def test_command_hook_runs_detached_with_env_and_a_log_per_attempt(hooks_on, tmp_path, monkeypatch):
    monkeypatch.setenv("IDEMPROXY_ADMIN_TOKEN", "not-for-agents")  # our settings stay ours
    out, script = tmp_path / "reported.json", tmp_path / "reporter.py"
    script.write_text(REPORTER)
    logs = tmp_path / "logs"
    hooks, store = await hooks_on(agent={"command": [sys.executable, str(script), str(out)],
                                         "log_dir": str(logs)})
    assert await hooks.fire("agent", *_call()) is None
    await hooks.wait_idle()

    seen = json.loads(out.read_text())
    token = seen["env"]["IDEM_RUN_TOKEN"]  # the run's capability: the proxy takes it for run r1 of default
    assert TenantResolver.from_settings(await tenant_secret(hooks._settings, store), hooks._settings) \
        .token_namespace(token, "r1") == "default"
    assert seen["env"] == {"IDEM_RUN_ID": "r1", "IDEM_EPOCH": "3", "IDEM_ATTEMPT": "2",
                           "IDEM_PROXY_URL": "http://proxy.test:8787",
                           "IDEM_RUN_BASE": f"http://proxy.test:8787/runs/r1/epochs/3/cap/{token}",
                           "IDEM_NAMESPACE": "default", "IDEM_RUN_TOKEN": token, "IDEM_EVENT": "restart"}
    assert seen["sid"] == seen["pid"]  # its own session: our signals and our exit are not its
    assert seen["stdin"] == ""
    log = logs / "default.r1.3.log"
    assert log.read_text().splitlines() == ["to stdout", "to stderr"]

    history = await _history(store)
    started = next(e for e in history if e["event"] == "hook-started")
    exited = next(e for e in history if e["event"] == "hook-exit")
    assert started["pid"] == seen["pid"] and started["log"] == str(log) and started["epoch"] == 3
    assert exited["code"] == 7 and exited["pid"] == seen["pid"]


async def test_on_dead_hook_gets_its_own_log(hooks_on, tmp_path):
    hooks, store = await hooks_on(alarm={"command": [sys.executable, "-c", "print('paged')"],
                                         "log_dir": str(tmp_path / "logs")})
    assert await hooks.fire("alarm", *_call(event="dead")) is None
    await hooks.wait_idle()
    assert (tmp_path / "logs" / "default.r1.3.dead.log").read_text() == "paged\n"


async def test_a_hook_that_cannot_start_is_recorded_as_failed(hooks_on, tmp_path):
    hooks, store = await hooks_on(agent={"command": [str(tmp_path / "no-such-agent")],
                                         "log_dir": str(tmp_path / "logs")})
    error = await hooks.fire("agent", *_call())
    assert error and "no-such-agent" in error
    assert await hooks.fire("unconfigured", *_call()) == "no hook named 'unconfigured' is configured"
    assert await hooks.fire(None, *_call()) == "the run has no hook"
    failed = [e for e in await _history(store) if e["event"] == "hook-failed"]
    assert len(failed) == 3 and failed[0]["hook"] == "agent" and "no-such-agent" in failed[0]["error"]


@pytest.fixture
async def receiver():
    """An HTTP hook receiver: answers the queued statuses, then 200; keeps what it got."""
    got: list[tuple[dict, bytes]] = []
    statuses: list[int] = []

    async def hook(request: web.Request) -> web.Response:
        got.append((dict(request.headers), await request.read()))
        return web.Response(status=statuses.pop(0) if statuses else 200, text="ok")

    app = web.Application()
    app.router.add_post("/hook", hook)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("/hook")), got, statuses
    await server.close()


@pytest.mark.slow  # waits out the hook's retry backoff
async def test_http_hook_is_signed_and_retried(hooks_on, receiver):
    url, got, statuses = receiver
    statuses += [503, 500]
    hooks, store = await hooks_on(pager={"url": url, "secret": "s3cret", "retries": 3})
    assert await hooks.fire("pager", *_call()) is None
    await hooks.wait_idle()

    assert len(got) == 3  # two failures, then delivered
    headers, raw = got[-1]
    expected = "sha256=" + hmac.new(b"s3cret", raw, hashlib.sha256).hexdigest()
    assert hmac.compare_digest(headers["Idem-Signature"], expected)
    body = json.loads(raw)
    assert {k: body[k] for k in ("run_id", "epoch", "attempt", "proxy_url", "run_base", "namespace",
                                 "token", "event")} == {
        "run_id": "r1", "epoch": 3, "attempt": 2, "proxy_url": "http://proxy.test:8787",
        "run_base": f"http://proxy.test:8787/runs/r1/epochs/3/cap/{body['token']}", "namespace": "default",
        "token": body["token"], "event": "restart"}
    assert headers["Idem-Timestamp"] == str(body["timestamp"])
    assert abs(body["timestamp"] - time.time()) < 60
    delivered = next(e for e in await _history(store) if e["event"] == "hook-delivered")
    assert delivered["tries"] == 3 and delivered["status"] == 200


@pytest.mark.slow  # waits out the hook's retry backoff
async def test_http_hook_failure_is_recorded(hooks_on, receiver):
    url, got, statuses = receiver
    statuses += [500, 502, 503]
    hooks, store = await hooks_on(pager={"url": url, "secret": "s", "retries": 2},
                                  picky={"url": url, "secret": "s", "retries": 5})
    await hooks.fire("pager", *_call())
    await hooks.wait_idle()
    failed = [e for e in await _history(store) if e["event"] == "hook-failed"]
    assert len(failed) == 1 and failed[0]["tries"] == 3 and "503" in failed[0]["error"]

    statuses.append(400)  # a refusal is final: not retried
    await hooks.fire("picky", *_call())
    await hooks.wait_idle()
    assert len(got) == 4
    failed = [e for e in await _history(store) if e["event"] == "hook-failed"]
    assert failed[-1]["tries"] == 1 and "400" in failed[-1]["error"]


# Writes its whole environment to argv[1].
ENV_REPORTER = "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w'))"


async def _environment_of(hooks, name: str, out) -> dict[str, str]:
    assert await hooks.fire(name, *_call()) is None
    await hooks.wait_idle()
    return json.loads(out.read_text())


async def test_a_command_hook_inherits_what_agents_need_and_no_infrastructure_secret(
        hooks_on, tmp_path, monkeypatch):
    ours = {"PGPASSWORD": "pg-secret", "DATABASE_URL": "postgresql://u:p@db/x", "REDIS_URL": "redis://:p@r",
            "REDISCLI_AUTH": "r-secret", "AWS_SECRET_ACCESS_KEY": "aws-secret",
            "AWS_SESSION_TOKEN": "aws-token",
            "IDEMPROXY_STORE_URL": "postgresql://u:p@db/idem", "IDEMPROXY_ADMIN_TOKEN": "admin",
            "OPENAI_API_KEY": "sk-agent", "ANTHROPIC_API_KEY": "sk-ant-agent", "AGENT_MODE": "fast"}
    for name, value in ours.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "env.json"
    command = [sys.executable, "-c", ENV_REPORTER, str(out)]
    hooks, _ = await hooks_on(
        inherit={"command": command, "log_dir": str(tmp_path / "logs")},
        added={"command": command, "log_dir": str(tmp_path / "logs"),
               "env": {"AGENT_MODE": "careful", "TOOLS_URL": "http://tools", "IDEM_EPOCH": "99"}},
        allowed={"command": command, "log_dir": str(tmp_path / "logs"),
                 "pass_env": ["PATH", "OPENAI_API_KEY", "PGPASSWORD", "NOT_SET"], "env": {"EXTRA": "1"}})

    env = await _environment_of(hooks, "inherit", out)
    assert {k: env.get(k) for k in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "AGENT_MODE", "PATH", "HOME")} == {
        "OPENAI_API_KEY": "sk-agent", "ANTHROPIC_API_KEY": "sk-ant-agent", "AGENT_MODE": "fast",
        "PATH": os.environ["PATH"], "HOME": os.environ["HOME"]}
    dropped = {"PGPASSWORD", "DATABASE_URL", "REDIS_URL", "REDISCLI_AUTH", "AWS_SECRET_ACCESS_KEY",
               "AWS_SESSION_TOKEN", "IDEMPROXY_STORE_URL", "IDEMPROXY_ADMIN_TOKEN"}
    assert not dropped & set(env)
    assert env["IDEM_RUN_ID"] == "r1" and env["IDEM_EPOCH"] == "3"

    env = await _environment_of(hooks, "added", out)
    assert (env["AGENT_MODE"], env["TOOLS_URL"], env["OPENAI_API_KEY"]) == (
        "careful", "http://tools", "sk-agent")
    assert env["IDEM_EPOCH"] == "3"  # the facts of the call are never overridden
    assert not dropped & set(env)

    env = await _environment_of(hooks, "allowed", out)
    facts = {k for k in env if k.startswith("IDEM_")}
    # an allowlist: exactly what it names (PGPASSWORD too, since it is asked for), plus `env` and the facts
    python_own = {"LC_CTYPE"}  # Python may set it in a C locale (PEP 538)
    assert set(env) - facts - python_own == {"PATH", "OPENAI_API_KEY", "PGPASSWORD", "EXTRA"}
    assert facts == {"IDEM_RUN_ID", "IDEM_EPOCH", "IDEM_ATTEMPT", "IDEM_PROXY_URL", "IDEM_RUN_BASE",
                     "IDEM_NAMESPACE", "IDEM_RUN_TOKEN", "IDEM_EVENT"}


def test_hook_env_options_load_from_toml_and_never_show_their_values(tmp_path):
    sections = proxy_sections("http://127.0.0.1:9", "sqlite:///unused.db", hooks__agent={
        "command": ["true"], "env": {"OPENAI_API_KEY": "sk-from-config", "RETRIES": 3}, "pass_env": []})
    hook = load_settings(write_config(tmp_path / "env.toml", sections), env={}).hooks["agent"]
    assert (dict(hook.env), hook.pass_env) == ({"OPENAI_API_KEY": "sk-from-config", "RETRIES": "3"}, ())
    assert "sk-from-config" not in repr(hook)
    sections["hooks.agent"] = {"command": ["true"]}
    hook = load_settings(write_config(tmp_path / "env.toml", sections),
                         env={"IDEMPROXY_HOOKS_AGENT_PASS_ENV": '["PATH", "HOME"]'}).hooks["agent"]
    assert (dict(hook.env), hook.pass_env) == ({}, ("PATH", "HOME"))  # unset: inherit (see above)


async def test_a_receiver_that_does_not_answer_holds_up_no_other_hook(hooks_on, receiver):
    """RECORDED_AT_ONCE bounds the store writes that record deliveries, not the deliveries:
    a receiver that takes every try to its timeout (down, behind a firewall) must not keep
    another hook's receiver from hearing of its restarts meanwhile."""
    import asyncio
    from idemproxy.supervisor.hooks import RECORDED_AT_ONCE
    url, got, _ = receiver
    release = asyncio.Event()

    async def silent(request: web.Request) -> web.Response:
        await release.wait()
        return web.Response(text="late")
    app = web.Application()
    app.router.add_post("/hook", silent)
    stuck = TestServer(app, host="127.0.0.1")
    await stuck.start_server()
    hooks, store = await hooks_on(stuck={"url": str(stuck.make_url("/hook")), "retries": 0},
                                  pager={"url": url, "retries": 0})
    try:
        for _ in range(RECORDED_AT_ONCE):
            assert await hooks.fire("stuck", *_call()) is None
        await asyncio.sleep(0.2)  # every stuck delivery is waiting on its receiver
        assert await hooks.fire("pager", *_call()) is None
        deadline = time.monotonic() + 3  # a stuck try lasts HTTP_TIMEOUT_S (10 s)
        while not got and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert len(got) == 1
    finally:
        release.set()
        await hooks.wait_idle()
        await stuck.close()
    delivered = [e for e in await _history(store) if e["event"] == "hook-delivered"]
    assert len(delivered) == RECORDED_AT_ONCE + 1
