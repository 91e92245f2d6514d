"""The tutorial, docs/getting-started.md, run by a test as a new user runs it.

Step by step from the page's own code blocks: a fresh venv and the page's install line; the fake
provider, ``idemproxy check`` and ``idemproxy serve`` with examples/config.toml, the keys exported
only where step 2 exports them; step 3's agent saved as agent.py and run, and ``runs list``
showing its run once, in one namespace, completed by the client; step 4's crash and resume,
``runs show``, ``runs list`` and the provider's counts, compared with what the page says.

Substituted, and only this: free ports instead of 8787 and 9100, and a temporary journal and
log folder instead of examples/ (``IDEMPROXY_*`` variables, as docs/configuration.md allows;
the agents find the proxy through ``IDEM_PROXY_URL``, as step 3 says). The fresh venv's
dependencies (pip, and the setuptools that builds the editable packages, too) come from the test
venv through one .pth file, instead of the package index: the install line itself runs and
installs both packages and the ``idemproxy`` command into the new venv in seconds, where
downloading them takes minutes; scripts/test installs the same extras from the index.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import pytest

import services

# a venv, a proxy, a provider and agents as processes; the timeout leaves room for a loaded machine
pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "getting-started.md"
KEYS = ("OPENAI_API_KEY", "ANTHROPIC_API_KEY")
HOOKS = ("openai_agent", "anthropic_agent", "langgraph_agent", "email_agent", "mcp_agent", "plain_agent")


def step(n: int) -> str:
    """The text of step ``n`` (its bold "**n. " heading to the next step's, or to "## Next")."""
    text = PAGE.read_text()
    after = text.split(f"**{n}. ", 1)[1]
    return re.split(rf"\*\*{n + 1}\. |\n## ", after, maxsplit=1)[0]


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def commands(n: int) -> list[str]:
    """Step ``n``'s shell lines, comments off."""
    return [line.split("  #")[0].strip() for block in blocks(step(n), "sh") for line in block.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def line_of(n: int, start: str) -> str:
    return next(line for line in commands(n) if line.startswith(start))


class Shell:
    """What a new user's shell holds after step 1's ``. .venv/bin/activate`` and step 2's
    exports, plus the substituted ports and paths; processes started in it, stopped at the end."""

    def __init__(self, venv: Path, work: Path, exported: dict[str, str]):
        self.provider_port, self.proxy_port = services.free_port(), services.free_port()
        self.proxy_url = f"http://127.0.0.1:{self.proxy_port}"
        provider = f"http://127.0.0.1:{self.provider_port}"
        inherited = {k: v for k, v in os.environ.items() if not k.startswith(("IDEMPROXY_", "IDEM_"))
                     and k not in (*KEYS, "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
        self.env = {**inherited, "VIRTUAL_ENV": str(venv), "PATH": f"{venv}/bin{os.pathsep}{os.environ['PATH']}",
                    **exported, "IDEMPROXY_SERVER_PORT": str(self.proxy_port),
                    "IDEMPROXY_STORE_URL": f"sqlite:///{work}/journal.db",
                    "IDEMPROXY_UPSTREAMS_OPENAI_URL": provider, "IDEMPROXY_UPSTREAMS_ANTHROPIC_URL": provider,
                    "IDEMPROXY_UPSTREAMS_TOOLS_URL": f"{provider}/tools", "IDEM_PROXY_URL": self.proxy_url,
                    **{f"IDEMPROXY_HOOKS_{hook.upper()}_LOG_DIR": str(work / "logs") for hook in HOOKS}}
        self.work, self.started, self._logs = work, [], []

    def argv(self, line: str) -> tuple[dict[str, str], list[str]]:
        """A page's command line as (its VAR=value prefixes, argv), its port the substituted one."""
        words = shlex.split(line.replace("9100", str(self.provider_port)).rstrip("&").strip())
        prefix = {}
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            name, _, value = words.pop(0).partition("=")
            prefix[name] = value
        return prefix, words

    def run(self, line: str, timeout: float = 60) -> subprocess.CompletedProcess:
        prefix, argv = self.argv(line)
        return subprocess.run(argv, cwd=REPO, env={**self.env, **prefix}, capture_output=True, text=True,
                              timeout=timeout)

    def start(self, line: str, name: str) -> subprocess.Popen:
        prefix, argv = self.argv(line)
        out = open(self.work / f"{name}.log", "wb")
        self._logs.append(out)
        process = subprocess.Popen(argv, cwd=REPO, env={**self.env, **prefix}, stdout=out, stderr=out)
        self.started.append(process)
        return process

    def wait(self, url: str, process: subprocess.Popen, name: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not services.reachable(url, 0.2):
            assert process.poll() is None and time.monotonic() < deadline, self.log(name)
            time.sleep(0.05)

    def log(self, name: str) -> str:
        return (self.work / f"{name}.log").read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        for process in reversed(self.started):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        for out in self._logs:
            out.close()


def installed(tmp_path: Path) -> Path:
    """Step 1 in a fresh venv (see the module's docstring for where its dependencies come from)."""
    venv = tmp_path / "venv"
    # without ensurepip's copy of pip: pip too comes from the test venv, through the .pth, and
    # bin/pip is the launcher ensurepip would write
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    purelib = subprocess.run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "test_venv_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    launcher = venv / "bin" / "pip"
    launcher.write_text(f"#!{venv}/bin/python\nimport sys\nfrom pip._internal.cli.main import main\nsys.exit(main())\n")
    launcher.chmod(0o755)
    (install,) = [line for line in commands(1) if "pip install" in line]
    assert commands(1)[0].startswith("python3 -m venv .venv && . .venv/bin/activate")
    # pip's PIP_NO_BUILD_ISOLATION=0 means no build isolation: the editable builds use the
    # setuptools the .pth shows instead of downloading one per package
    done = subprocess.run(["sh", "-c", f". {shlex.quote(str(venv))}/bin/activate && {install}"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PIP_NO_BUILD_ISOLATION": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (venv / "bin" / "idemproxy").exists()
    return venv


def exports() -> dict[str, str]:
    """What step 2 exports before it starts anything."""
    exported = {}
    for line in commands(2):
        if line.startswith("export "):
            exported.update(word.split("=", 1) for word in line.split()[1:])
    return exported


def admin_run(shell: Shell, run_id: str) -> dict | None:
    request = urllib.request.Request(f"{shell.proxy_url}/admin/runs/{run_id}",
                                     headers={"Authorization": "Bearer examples-admin-token"})
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return None
        raise


def listed(output: str) -> list[list[str]]:
    """The rows of ``runs list``'s table, its header off."""
    rows = [line.split() for line in output.splitlines() if line.strip()]
    assert rows and rows[0][:3] == ["RUN", "NAMESPACE", "STATE"], output
    return rows[1:]


def test_the_tutorial_as_a_new_user_runs_it(tmp_path):
    venv = installed(tmp_path)
    exported = exports()
    assert set(KEYS) <= exported.keys()
    shell = Shell(venv, tmp_path, exported)
    try:
        provider = shell.start(line_of(2, "python tests/support/fake_provider.py --port 9100"), "provider")
        shell.wait(f"http://127.0.0.1:{shell.provider_port}/_calls", provider, "provider")
        migrated = shell.run(line_of(2, "idemproxy migrate --config examples/config.toml"))
        assert migrated.returncode == 0, migrated.stderr
        check = shell.run(line_of(2, "idemproxy check --config examples/config.toml"))
        assert check.returncode == 0 and "warning" not in check.stderr.lower(), check.stderr
        proxy = shell.start(line_of(2, "idemproxy serve --config examples/config.toml"), "proxy")
        shell.wait(f"{shell.proxy_url}/healthz", proxy, "proxy")

        # step 3: the client's agent, saved as agent.py and run in the same shell
        (agent,) = blocks(step(3), "python")
        (tmp_path / "agent.py").write_text(agent)
        ran = shell.run(f"python {tmp_path / 'agent.py'}")
        assert ran.returncode == 0, ran.stderr[-3000:]
        listing = shell.run(line_of(3, "idemproxy runs list --config examples/config.toml"))
        assert listing.returncode == 0, listing.stderr
        (order,) = listed(listing.stdout)
        assert order[0] == "order-42" and order[2] == "completed" and order[1].startswith("r:"), listing.stdout

        # step 4: crash it and watch it resume
        crashed = shell.run(line_of(4, "IDEM_RUN_ID=demo-1 python examples/openai_agent.py"))
        assert crashed.returncode == -signal.SIGKILL, crashed.stdout + crashed.stderr
        deadline, run = time.monotonic() + 40, None
        while time.monotonic() < deadline:
            run = admin_run(shell, "demo-1")
            started = {e["epoch"] for e in (run or {}).get("history", []) if e["event"] == "hook-started"}
            exited = {e["epoch"] for e in (run or {}).get("history", []) if e["event"] == "hook-exit"}
            if run and run["state"] == "completed" and started <= exited:
                break
            time.sleep(0.2)
        assert run and run["state"] == "completed" and run["epoch"] >= 1, (run, shell.log("proxy"))
        shown = shell.run(line_of(4, "idemproxy runs show demo-1 --config examples/config.toml"))
        assert shown.returncode == 0 and re.search(r"state\s+completed", shown.stdout), shown.stdout + shown.stderr
        listing = shell.run(line_of(4, "idemproxy runs list --config examples/config.toml"))
        rows = listed(listing.stdout)
        assert sorted(row[0] for row in rows) == ["demo-1", "order-42"], listing.stdout  # each run once
        assert all(row[2] == "completed" and row[1].startswith("r:") for row in rows), listing.stdout

        said = json.loads(re.search(r"curl -s localhost:9100/_calls\s+# (\{.*?\})", step(4)).group(1))
        with urllib.request.urlopen(f"http://127.0.0.1:{shell.provider_port}/_calls", timeout=5) as answer:
            assert json.loads(answer.read()) == said  # each call paid once, as the page says
    finally:
        shell.stop()

