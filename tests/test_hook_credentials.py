"""The tutorial's credential trap (issue 26 item 3): a command hook's agent inherits the
proxy's environment, so keys exported in the agent's shell only are gone from every
restarted attempt. ``idemproxy check`` warns; the tutorial exports the keys where the proxy
starts, and its configuration passes ``check`` that way, with no warning."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from idemproxy.proxy.config import load_settings
from idemproxy.supervisor.credentials import missing_credentials

ROOT = Path(__file__).resolve().parent.parent
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
