"""The tutorial's credential trap: a command hook's agent inherits the
proxy's environment, so keys exported in the agent's shell only are gone from every
restarted attempt. ``idemproxy check`` warns; the tutorial exports the keys where the proxy
starts, and its configuration passes ``check`` that way, with no warning."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import services

from idemproxy.proxy.config import load_settings
from idemproxy.supervisor.credentials import missing_credentials

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "config.toml"
KEYS = ("OPENAI_API_KEY", "ANTHROPIC_API_KEY")


def idemproxy(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("IDEMPROXY_") and k not in KEYS}
    return subprocess.run([sys.executable, "-m", "idemproxy.proxy.cli", *args], cwd=ROOT, timeout=60,
                          capture_output=True, text=True, env={**base, **env})


def tutorial_exports() -> dict[str, str]:
    """What step 2 of docs/getting-started.md exports before it starts the proxy."""
    step = (ROOT / "docs" / "getting-started.md").read_text().split("**2. ", 1)[1].split("**3. ", 1)[0]
    commands = re.search(r"```sh\n(.*?)```", step, re.S).group(1).splitlines()
    serve = next(i for i, line in enumerate(commands) if line.startswith("idemproxy serve"))
    exported = {}
    for line in commands[:serve]:
        if line.startswith("export "):
            exported.update(word.split("=", 1) for word in line.split()[1:])
    return exported


@pytest.mark.slow  # three idemproxy processes
def test_the_tutorials_proxy_gives_its_hooks_the_keys_and_check_says_when_it_would_not(tmp_path):
    exported = tutorial_exports()
    assert set(KEYS) <= exported.keys()  # exported in the shell that starts the proxy
    store = f"sqlite:///{tmp_path}/journal.db"
    assert idemproxy("migrate", "--store", store, env={}).returncode == 0
    as_told = idemproxy("check", "--config", str(EXAMPLES), "--store", store, env=exported)
    assert as_told.returncode == 0 and "warning" not in as_told.stderr, as_told.stderr

    agent_shell_only = idemproxy("check", "--config", str(EXAMPLES), "--store", store, env={})
    assert agent_shell_only.returncode == 0  # a warning is no failure: check stays a health check
    warnings = [line for line in agent_shell_only.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 2, agent_shell_only.stderr
    openai = next(w for w in warnings if "OPENAI_API_KEY" in w)
    assert "[upstreams.openai]" in openai and "plain_agent" in openai and "openai_agent" in openai
    assert "Traceback" not in agent_shell_only.stderr


@pytest.mark.slow  # a proxy process
def test_serve_says_so_at_start_too(tmp_path):
    """Whoever starts the proxy without `check` reads the same warning in its log."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("IDEMPROXY_") and k not in KEYS}
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "idemproxy.proxy.cli", "serve", "--config", str(EXAMPLES),
                                 "--port", str(services.free_port()), "--store", f"sqlite:///{tmp_path}/j.db"],
                                cwd=ROOT, env=base, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 30
        while "supervisor watching" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.05)
        time.sleep(0.2)
        warned = [line for line in log.read_text().splitlines() if "WARNING" in line and "will not have" in line]
        assert len(warned) == 2 and "OPENAI_API_KEY" in warned[0] + warned[1], log.read_text()
    finally:
        proc.terminate()
        proc.wait(15)


def test_pass_env_env_and_set_headers_decide_what_a_hooks_agent_lacks(tmp_path):
    config = tmp_path / "idemproxy.toml"
    config.write_text("""
[upstreams.llm]
url = "https://api.openai.com"
[upstreams.anthropic]
url = "http://127.0.0.1:9100"
set_headers = { x-api-key = "sk-ant-injected" }
[upstreams.tools]
url = "http://127.0.0.1:9100/tools"

[hooks.inherits]
command = ["python", "agent.py"]
[hooks.narrowed]
command = ["python", "agent.py"]
pass_env = ["PATH", "HOME"]
[hooks.given]
command = ["python", "agent.py"]
pass_env = ["PATH"]
env = { OPENAI_API_KEY = "sk-in-the-hook" }
[hooks.webhook]
url = "https://example.com/restart"
""")
    settings = load_settings(config, env={})
    warned = missing_credentials(settings, {"PATH": "/usr/bin", "OPENAI_API_KEY": "sk-live"})
    # the key is here, but pass_env leaves it out of `narrowed`; `given` has its own; a webhook starts
    # nothing here; anthropic's key is injected by the proxy, and `tools` is no provider's
    assert len(warned) == 1 and "hook narrowed will not have OPENAI_API_KEY" in warned[0], warned
    assert "[upstreams.llm]" in warned[0]
    warned = missing_credentials(settings, {"PATH": "/usr/bin"})
    assert len(warned) == 1 and "hooks inherits, narrowed will not have OPENAI_API_KEY" in warned[0], warned
    assert missing_credentials(settings, {"OPENAI_API_KEY": "sk", "PATH": "/usr/bin"}) != []
    config.write_text(config.read_text().replace('pass_env = ["PATH", "HOME"]', 'pass_env = ["OPENAI_API_KEY"]'))
    assert missing_credentials(load_settings(config, env={}), {"OPENAI_API_KEY": "sk"}) == []
