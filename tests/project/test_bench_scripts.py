"""Every benchmark script starts: ``python bench/X.py --help`` exits 0 for each one with a
command line. They run by hand, not in CI, so a helper moved in the tests (the soak once
imported one from the tests' conftest, which only pytest can import) would break them
unseen until someone needs the figures."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(path for path in (REPO / "bench").glob("*.py") if "ArgumentParser(" in path.read_text())


async def test_every_benchmark_script_starts():
    assert len(SCRIPTS) >= 10, SCRIPTS  # the glob found the scripts

    async def help_of(script: Path) -> tuple[str, int | None, bytes]:
        process = await asyncio.create_subprocess_exec(sys.executable, str(script), "--help", cwd=REPO,
                                                       stdout=asyncio.subprocess.PIPE,
                                                       stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(process.communicate(), 120)
        return script.name, process.returncode, err
    failed = [(name, code, err.decode()[-500:]) for name, code, err in
              await asyncio.gather(*(help_of(script) for script in SCRIPTS)) if code != 0]
    assert not failed, failed
