"""The scenario idemproxy exists for, with real parts end to end.

A real ``idemproxy serve`` process with the supervisor in-process; an agent process on the
official ``openai`` SDK and ``httpx``, configured only by the hook's environment, doing 240
steps (a model call and a tool POST each) and SIGKILLing itself after step 200 of its first
attempt. The supervisor notices the silence and restarts it through the command hook; the
new attempt replays steps 1-200 from the journal and goes live at 201. The fake provider
counts exactly 240 model calls and 240 tool calls; the run ends completed, epoch 1, one
restart. Runs on SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import pytest

from conftest import BACKENDS, backend_url, proxy_sections

pytestmark = pytest.mark.slow  # a 240-step agent process SIGKILLed and resumed through a proxy process

AGENT = Path(__file__).resolve().parents[1] / "support" / "agents" / "resumable_agent.py"
RUN = "e2e-agent"


@pytest.fixture(params=[b for b in ("sqlite", "postgres") if b in BACKENDS])
def durable_store(request, tmp_path):
    url, cleanup = backend_url(request.param, tmp_path)
    yield request.param, url
    cleanup()


def _events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


async def _run_state(http, url: str) -> dict | None:
    # the admin view: the history of restarts and hook exits is for operators only
    async with http.get(f"{url}/admin/runs/{RUN}", headers={"Authorization": "Bearer test-admin-token"}) as resp:
        return await resp.json() if resp.status == 200 else None


async def test_agent_killed_at_step_200_resumes_and_completes(durable_store, provider, proxy_process,
                                                              http, tmp_path):
    backend, store_url = durable_store
    logs = tmp_path / "hook-logs"
    sections = proxy_sections(
        provider.url, store_url,
        supervisor={"enabled": True, "interval_s": 0.2},
        runs={"timeout_s": 2, "grace_s": 3, "max_restarts": 3, "hook": "agent",
              "backoff_base_s": 0.5},
        **{"hooks.agent": {"command": [sys.executable, str(AGENT)], "log_dir": str(logs),
                           "allow_tenants": ["default"]}})
    agent_env = {"OPENAI_API_KEY": "sk-agent-test"}
    proxy = proxy_process(sections, env=agent_env)

    # The first attempt, started the way a user or a job runner would, with the same
    # environment a hook gives.
    first_log = tmp_path / "attempt-0.log"
    env = {**os.environ, **agent_env, "IDEM_RUN_ID": RUN, "IDEM_EPOCH": "0", "IDEM_ATTEMPT": "0",
           "IDEM_PROXY_URL": proxy.url, "IDEM_RUN_BASE": f"{proxy.url}/runs/{RUN}/epochs/0",
           "IDEM_NAMESPACE": "default"}
    with open(first_log, "wb") as out:
        first = await asyncio.create_subprocess_exec(sys.executable, str(AGENT), env=env,
                                                     stdout=out, stderr=asyncio.subprocess.STDOUT)
    assert await asyncio.wait_for(first.wait(), 40) == -9, first_log.read_text()[-2000:]

    deadline = time.monotonic() + 40
    run = None
    while time.monotonic() < deadline:  # until the run ended and its agent's exit is recorded
        run = await _run_state(http, proxy.url)
        if run and run["state"] in ("failed", "dead"):
            break
        if run and run["state"] == "completed" and any(e["event"] == "hook-exit" for e in run["history"]):
            break
        await asyncio.sleep(0.2)
    second_log = logs / f"default.{RUN}.1.log"
    assert run is not None and run["state"] == "completed", (run, _tail(second_log), _tail(proxy.log))
    assert run["epoch"] == 1 and run["restarts"] == 1
    assert provider.calls["chat"] == 240
    assert provider.calls["tool:send_email"] == 240

    first_events, second_events = _events(first_log), _events(second_log)
    crash = next(e for e in first_events if e["event"] == "crash")
    assert crash["step"] == 200
    start = next(e for e in second_events if e["event"] == "start")
    live = next(e for e in second_events if e["event"] == "live")
    replayed = next(e for e in second_events if e["event"] == "replayed")
    done = next(e for e in second_events if e["event"] == "done")
    assert start["epoch"] == 1 and start["attempt"] == "1"
    assert live["step"] == 201  # went live exactly where the first attempt died
    assert done["replayed"] == {"chat": 200, "tool": 200}
    restart_at = next(e["at"] for e in run["history"] if e["event"] == "restart")
    exit_code = next(e["code"] for e in run["history"] if e["event"] == "hook-exit")
    assert exit_code == 0

    figures = {
        "backend": backend,
        "timeout_s": 2, "grace_s": 3, "interval_s": 0.2,
        "crash_to_restart_claim_s": round(restart_at - crash["t"], 3),
        "crash_to_new_process_s": round(start["t"] - crash["t"], 3),
        "replay_200_steps_s": round(replayed["since_first_request"], 3),
        "restart_claim_to_first_live_step_s": round(live["t"] - restart_at, 3),
        "first_attempt_200_live_steps_s": round(crash["t"] - next(
            e["t"] for e in first_events if e["event"] == "start"), 3),
    }
    print("\nE2E FIGURES " + json.dumps(figures))
    (tmp_path / f"e2e-figures-{backend}.json").write_text(json.dumps(figures, indent=2))
    out = os.environ.get("IDEMPROXY_E2E_FIGURES")
    if out:  # collect figures across runs for the report
        with open(out, "a") as fh:
            fh.write(json.dumps(figures) + "\n")


def _tail(path: Path) -> str:
    return path.read_text()[-3000:] if path.exists() else f"({path} missing)"
