"""Instructions idemproxy spends per request, counted by callgrind: the same count for the same
code and inputs whatever else the machine does, so two checkouts compare on a busy machine.

    python bench/instructions.py [--requests 200] [--scenarios passthrough,replay,record]

Starts nginx's fixed completion (bench/nginx.py) and ``idemproxy serve`` on SQLite under
``valgrind --tool=callgrind``; for each scenario, warms it up, zeroes the counters, sends
``--requests`` requests one after another, dumps, and prints the proxy's instructions per
request. ``PYTHONPATH`` chooses the idemproxy under test, so a before/after comparison is
two runs of this script with two checkouts. Requests are sequential: this counts the
proxy's own work per request, not how it behaves under concurrency (bench/run.py does that).
"""

from __future__ import annotations

import argparse
import glob
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from nginx import CHAT_PATH  # noqa: E402
from processes import Processes, http  # noqa: E402
from run import BODY, HEADERS  # noqa: E402

TOTALS = re.compile(rb"^(?:summary|totals):\s*(\d+)", re.MULTILINE)
SCENARIOS = {  # name -> extra headers; the key of "record" is fresh per request
    "passthrough": {"Idem-Policy": "passthrough"},
    "replay": {"Idempotency-Key": "instructions-replay"},
    "record": {},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--keep", type=Path, help="copy each scenario's callgrind dump here (callgrind_annotate)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="idem-instr-") as tmp, Processes(Path(tmp)) as procs:
        workdir = Path(tmp)
        upstream = procs.nginx()
        proxy = procs.idemproxy("proxy", upstream.url, f"sqlite:///{workdir}/journal.db", workers=1,
                                wrap=["valgrind", "--tool=callgrind", f"--callgrind-out-file={workdir}/cg.%p",
                                          "--dump-instr=no", "--dump-line=no"])
        for name in args.scenarios.split(","):
            per_request = measure(proxy, name, args.requests, args.warmup, workdir, args.keep)
            print(f"{name:12s} {per_request:12,.0f} instructions per request", flush=True)
    return 0


def measure(proxy, name: str, requests: int, warmup: int, workdir: Path, keep: Path | None = None) -> float:
    def send(n: int, tag: str) -> None:
        for i in range(n):
            headers = {**dict(HEADERS), **SCENARIOS[name]}
            if name == "record":
                headers["Idempotency-Key"] = f"instructions-{tag}-{i}"
            status, _, _ = http("POST", proxy.url + "/openai" + CHAT_PATH, BODY.encode(), headers, timeout=60)
            if status != 200:
                raise SystemExit(f"{name}: answered {status}")
    send(warmup, "warm")
    before = set(glob.glob(f"{workdir}/cg.*"))
    subprocess.run(["callgrind_control", "--zero", str(proxy.popen.pid)], check=True, capture_output=True)
    send(requests, "measured")
    subprocess.run(["callgrind_control", "--dump", str(proxy.popen.pid)], check=True, capture_output=True)
    (dump,) = set(glob.glob(f"{workdir}/cg.*")) - before
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        shutil.copy(dump, keep / f"callgrind.{name}")
    return int(TOTALS.search(Path(dump).read_bytes()).group(1)) / requests


if __name__ == "__main__":
    sys.exit(main())
