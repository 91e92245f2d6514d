"""A JavaScript agent on @idemproxy/client, killed and restarted by the supervisor.

examples/js_agent.mjs (the OpenAI Node SDK through ``run.url``/``run.headers``, tool POSTs
with ``run.key``) is started the way a person starts it, registers its run with the hook
``js_agent`` and SIGKILLs itself after step 3 of 6. A real ``idemproxy serve`` with its
supervisor notices the silence and starts it again through a command hook that runs
``node``; the new attempt (handed IDEM_RUN_ID, IDEM_EPOCH and IDEM_RUN_TOKEN) replays steps
1-3 from the journal and goes live at step 4. The fake provider counts exactly one model
call and one tool call per step.

The package is used as built in clients/typescript (``npm ci && npm run build`` there;
scripts/test does it before pytest), linked into a scratch project as a user installs it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

import idemproxy_client
from conftest import REPO, proxy_sections

PACKAGE = REPO / "clients" / "typescript"
AGENT = REPO / "examples" / "js_agent.mjs"
NODE = shutil.which("node")
RUN = "js-agent"
STEPS, CRASH_AT = 6, 3


@pytest.fixture
def js_project(tmp_path) -> Path:
    """A scratch project with the example and its two packages installed (linked)."""
    if NODE is None:
        pytest.skip("node is not installed")
    if not (PACKAGE / "node_modules" / "openai").is_dir():
        pytest.skip("clients/typescript has no node_modules: run `npm ci` there (scripts/test does)")
    if not (PACKAGE / "dist" / "index.js").exists():
        subprocess.run(["npm", "run", "build", "--silent"], cwd=PACKAGE, check=True, timeout=120)
    project = tmp_path / "js-project"
    (project / "node_modules" / "@idemproxy").mkdir(parents=True)
    (project / "node_modules" / "@idemproxy" / "client").symlink_to(PACKAGE, target_is_directory=True)
    (project / "node_modules" / "openai").symlink_to(PACKAGE / "node_modules" / "openai", target_is_directory=True)
    (project / "package.json").write_text(json.dumps({"name": "js-agent", "private": True, "type": "module"}))
    shutil.copy(AGENT, project / AGENT.name)
    return project


def test_the_package_is_the_python_clients_twin_in_version_and_shape():
    manifest = json.loads((PACKAGE / "package.json").read_text())
    assert manifest["name"] == "@idemproxy/client" and manifest["type"] == "module"
    assert manifest["version"] == idemproxy_client.__version__
    assert f'VERSION = "{idemproxy_client.__version__}"' in (PACKAGE / "src" / "index.ts").read_text()
    assert "dependencies" not in manifest and manifest["types"] == "./dist/index.d.ts"
    assert (PACKAGE / "package-lock.json").exists()  # npm ci in scripts/test installs exactly it


def served(output: str) -> list[list]:
    """[[step, model, tool, reply], ...] from the agent's "step n/N: model X, tool Y: reply" lines."""
    rows = []
    for line in output.splitlines():
        if line.startswith("step "):
            head, how, reply = line.split(": ", 2)
            model, tool = (part.split()[1] for part in how.split(", "))
            rows.append([int(head.split()[1].split("/")[0]), model, tool, reply])
    return rows


@pytest.mark.slow  # a node agent process SIGKILLed and restarted through a proxy process
async def test_js_agent_killed_at_step_3_is_restarted_by_a_node_hook_and_replays(
        js_project, provider, proxy_process, http, sqlite_url, tmp_path):
    logs = tmp_path / "hook-logs"
    agent = js_project / AGENT.name
    sections = proxy_sections(
        provider.url, sqlite_url,
        supervisor={"enabled": True, "interval_s": 0.2},
        runs={"timeout_s": 2, "grace_s": 3, "max_restarts": 3, "backoff_base_s": 0.5},
        **{"hooks.js_agent": {"command": [NODE, str(agent)], "log_dir": str(logs), "allow_tenants": ["default"]}})
    agent_env = {"OPENAI_API_KEY": "sk-agent-test"}  # the hook's agent inherits the proxy's environment
    proxy = proxy_process(sections, env=agent_env)

    first_log = tmp_path / "attempt-0.log"
    env = {**os.environ, **agent_env, "IDEM_RUN_ID": RUN, "IDEM_PROXY_URL": proxy.url}
    for name in ("IDEM_EPOCH", "IDEM_ATTEMPT", "IDEM_RUN_TOKEN", "IDEM_NAMESPACE", "IDEM_STANDBY"):
        env.pop(name, None)
    started = time.monotonic()
    with open(first_log, "wb") as out:
        first = await asyncio.create_subprocess_exec(
            NODE, str(agent), "--steps", str(STEPS), "--crash-at", str(CRASH_AT), env=env, cwd=js_project,
            stdout=out, stderr=asyncio.subprocess.STDOUT)
    assert await asyncio.wait_for(first.wait(), 30) == -9, first_log.read_text()[-2000:]

    run = None
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:  # until the run ended and its agent's exit is recorded
        async with http.get(f"{proxy.url}/admin/runs/{RUN}",
                            headers={"Authorization": "Bearer test-admin-token"}) as resp:
            run = await resp.json() if resp.status == 200 else None
        if run and run["state"] in ("failed", "dead"):
            break
        if run and run["state"] == "completed" and any(e["event"] == "hook-exit" for e in run["history"]):
            break
        await asyncio.sleep(0.2)
    second_log = logs / f"default.{RUN}.1.log"
    second_tail = second_log.read_text()[-3000:] if second_log.exists() else "(none)"
    why = (f"{run}\n--- first\n{first_log.read_text()[-2000:]}\n--- second\n{second_tail}"
           f"\n--- proxy\n{proxy.log.read_text()[-3000:]}")
    assert run is not None and run["state"] == "completed", why
    assert run["epoch"] == 1 and run["restarts"] == 1, why
    assert next(e["code"] for e in run["history"] if e["event"] == "hook-exit") == 0, why
    assert provider.calls["chat"] == STEPS and provider.calls["tool:record_step"] == STEPS, why

    first_steps, second_steps = served(first_log.read_text()), served(second_log.read_text())
    assert [row[:3] for row in first_steps] == [[n, "live", "live"] for n in range(1, CRASH_AT + 1)], why
    assert [row[:3] for row in second_steps] == (
        [[n, "replayed", "replayed"] for n in range(1, CRASH_AT + 1)]
        + [[n, "live", "live"] for n in range(CRASH_AT + 1, STEPS + 1)]), why
    # A replay is the recorded answer: the restarted attempt saw the first one's replies.
    assert [row[3] for row in second_steps[:CRASH_AT]] == [row[3] for row in first_steps]
    assert len({row[3] for row in second_steps}) == STEPS
    second_output = second_log.read_text()
    assert f"run {RUN} epoch 1: {STEPS} steps" in second_output
    assert f"done: {STEPS} steps, run {RUN} is completed" in second_output
    print(f"\nJS AGENT FIGURES {json.dumps({'first_start_to_completed_s': round(time.monotonic() - started, 2)})}")
