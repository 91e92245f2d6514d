"""The peers bench/peers.py measures, installed and started: LiteLLM's proxy and the Portkey gateway.

Each is installed at a pinned version into a folder of its own, outside the repository and
outside any project venv: by default ``~/.cache/idemproxy-bench/peers`` (``$XDG_CACHE_HOME``
is honoured), with LiteLLM in a venv of its own (``litellm/``, from PyPI) and the gateway in an
npm folder (``portkey/``, from npm). Installing again at the same versions does nothing.

Both are started the way their documentation starts them, one process each, logging errors
only, on 127.0.0.1, in front of the benchmark's provider:

- LiteLLM: ``litellm --config ... --num_workers 1`` (uvicorn in the same process; its default
  transport, h11, since ``litellm[proxy]`` does not bring httptools), the provider as an
  ``openai/`` model with its ``api_base``, a master key (it refuses to start without one), and
  ``cache: true`` with ``type: local`` (its in-memory cache) for the cache-hit mode.
  ``LITELLM_LOCAL_MODEL_COST_MAP`` keeps it from fetching its price list from the internet.
- Portkey: ``node build/start-server.js --headless`` with ``NODE_ENV=production``; the upstream
  is named per request (``x-portkey-provider: openai``, ``x-portkey-custom-host``), as the
  open-source gateway has no server-side configuration. Its cache lookups need a store that
  only Portkey's hosted build provides (the open-source build answers
  ``x-portkey-cache-status: DISABLED``), so it has no cache-hit mode here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from processes import BenchError, Processes, Server, free_port, http

LITELLM_VERSION = "1.106.12"  # 1.107.0 was withdrawn from PyPI; 1.110.x needs a package PyPI lacks
PORTKEY_VERSION = "1.15.2"
LITELLM_SPEC = f"litellm[proxy]=={LITELLM_VERSION}"
PORTKEY_SPEC = f"@portkey-ai/gateway@{PORTKEY_VERSION}"
# LiteLLM refuses to start without a master key, and with a short one; requests carry it.
LITELLM_KEY = "sk-bench-" + "0123456789abcdef" * 4
LITELLM_MODEL = "gpt-bench"  # the model the benchmark's body asks for
INSTALL_TIMEOUT_S = 900


def default_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "idemproxy-bench" / "peers"


def _litellm_bin(root: Path) -> Path:
    return root / "litellm" / "bin" / "litellm"


def _portkey_package(root: Path) -> Path:
    return root / "portkey" / "node_modules" / "@portkey-ai" / "gateway"


def installed(root: Path) -> dict[str, str | None]:
    """The version of each peer installed under ``root`` (None: not there)."""
    stamp = root / "litellm" / "installed.txt"  # written after a successful pip install
    litellm = stamp.read_text().strip() if stamp.exists() and _litellm_bin(root).exists() else None
    try:
        portkey = json.loads((_portkey_package(root) / "package.json").read_text())["version"]
    except (OSError, ValueError, KeyError):
        portkey = None
    return {"litellm": litellm, "portkey": portkey}


def install(root: Path) -> None:
    """Install whichever peer is missing or at another version (minutes, once)."""
    have = installed(root)
    root.mkdir(parents=True, exist_ok=True)
    if have["litellm"] != LITELLM_VERSION:
        print(f"installing {LITELLM_SPEC} into {root / 'litellm'} (a venv; 2-3 minutes)", flush=True)
        venv = root / "litellm"
        if not (venv / "bin" / "pip").exists():
            _run([sys.executable, "-m", "venv", str(venv)], root)
        _run([str(venv / "bin" / "pip"), "install", "-q", LITELLM_SPEC], root)
        (venv / "installed.txt").write_text(LITELLM_VERSION + "\n")
    if have["portkey"] != PORTKEY_VERSION:
        print(f"installing {PORTKEY_SPEC} into {root / 'portkey'} (npm; under a minute)", flush=True)
        (root / "portkey").mkdir(exist_ok=True)
        _run(["npm", "install", "--no-audit", "--no-fund", "--loglevel=error", PORTKEY_SPEC], root / "portkey")
    if installed(root) != {"litellm": LITELLM_VERSION, "portkey": PORTKEY_VERSION}:
        raise BenchError(f"install under {root} did not give the pinned versions: {installed(root)}")


def _run(argv: list[str], cwd: Path) -> None:
    try:
        subprocess.run(argv, cwd=cwd, check=True, timeout=INSTALL_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        raise BenchError(f"{' '.join(argv)}: {exc}") from None


def litellm(procs: Processes, root: Path, provider: str, cache: bool) -> Server:
    port = free_port()
    name = f"litellm-{'cache' if cache else 'pass'}"
    config = procs.workdir / f"{name}.yaml"
    config.write_text(
        f"model_list:\n  - model_name: {LITELLM_MODEL}\n    litellm_params:\n"
        f"      model: openai/{LITELLM_MODEL}\n      api_base: {provider}/v1\n"
        "      api_key: sk-bench-not-a-real-key\n"
        "litellm_settings:\n  telemetry: false\n  set_verbose: false\n"
        # an hour: longer than any run, so that no entry expires while measured (default 600 s)
        + ("  cache: true\n  cache_params:\n    type: local\n    ttl: 3600\n" if cache else ""))
    env = {"LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
           "DISABLE_SCHEMA_UPDATE": "True", "LITELLM_MASTER_KEY": LITELLM_KEY}
    return procs.start(name, [str(_litellm_bin(root)), "--config", str(config), "--host", "127.0.0.1",
                              "--port", str(port), "--num_workers", "1"], port,
                       lambda s: http("GET", s.url + "/health/liveliness", timeout=1)[0] == 200,
                       timeout=180, env=env)


def litellm_headers(content_type: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    """The benchmark's headers with LiteLLM's master key as the credential."""
    return (content_type, ("Authorization", f"Bearer {LITELLM_KEY}"))


def portkey(procs: Processes, root: Path) -> Server:
    port = free_port()
    script = _portkey_package(root) / "build" / "start-server.js"
    return procs.start("portkey", ["node", str(script), f"--port={port}", "--headless"], port,
                       lambda s: http("GET", s.url + "/", timeout=1)[0] == 200, timeout=60,
                       env={"NODE_ENV": "production"})


def portkey_headers(provider: str) -> tuple[tuple[str, str], ...]:
    """What the open-source gateway needs to know where to send a request."""
    return (("x-portkey-provider", "openai"), ("x-portkey-custom-host", provider + "/v1"))


def runtimes(root: Path) -> dict[str, str]:
    """The interpreters the peers run on (their speed depends on them)."""
    def version(argv: list[str]) -> str:
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
            return (out.stdout or out.stderr).strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            return "unknown"
    return {"node": version(["node", "--version"]).lstrip("v"),
            "python": version([str(root / "litellm" / "bin" / "python"), "--version"]).split()[-1]}
