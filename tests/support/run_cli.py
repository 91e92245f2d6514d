"""The `idemproxy` command run as a user runs it: a subprocess, with no IDEMPROXY_* variable of
the test's own environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def idemproxy(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 60):
    base = {k: v for k, v in os.environ.items() if not k.startswith("IDEMPROXY_")}
    return subprocess.run([sys.executable, "-m", "idemproxy.proxy.cli", *args], cwd=cwd, timeout=timeout,
                          capture_output=True, text=True, env={**base, **(env or {})})
