"""Load generators: wrk (preferred), or a Python one when wrk is not installed.

Both run in processes of their own, never in the process being measured, keep a fixed
number of connections busy (a closed loop: each connection sends its next request when
the previous answer arrives), and report the same summary: completed requests,
requests/s, latency percentiles, and errors (transport errors and answers >= 400).

Why wrk first: the machine has two cores, shared by the upstream, the proxy under test
and the load generator. wrk spends a few microseconds of C per request, so nearly all of
the CPU goes to what is measured; a Python client spends about as much per request as
the proxy itself, so its numbers say as much about the client as about the proxy. The
Python generator is there so that the benchmark runs anywhere; its results are marked.

    python bench/loadgen.py --url http://127.0.0.1:8787/openai/small --connections 32 \
        --duration 5 --body '{}' --header 'Content-Type: application/json'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from serving import run as run_on_uvloop

WRK_SCRIPT = Path(__file__).with_name("wrk.lua")


@dataclass(frozen=True)
class Load:
    """One closed-loop run: the same POST to ``url`` from ``connections`` connections."""
    url: str
    connections: int
    duration: float
    body: str
    headers: tuple[tuple[str, str], ...] = ()
    key: str = ""         # the same Idempotency-Key on every request
    key_prefix: str = ""  # a fresh Idempotency-Key per request


@dataclass
class Summary:
    requests: int
    seconds: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    errors: dict[str, int] = field(default_factory=dict)

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    @property
    def failed(self) -> int:
        return sum(self.errors.values())


def available(kind: str) -> str:
    """``wrk`` or ``python``: the generator to use for ``auto`` and a check of the others."""
    has_wrk = shutil.which("wrk") is not None
    if kind == "auto":
        return "wrk" if has_wrk else "python"
    if kind == "wrk" and not has_wrk:
        raise RuntimeError("wrk is not installed (apt-get install wrk), or use --loadgen python")
    return kind


def run(kind: str, load: Load) -> Summary:
    return run_wrk(load) if kind == "wrk" else run_python(load)


def run_wrk(load: Load) -> Summary:
    env = {**os.environ, "BENCH_BODY": load.body, "BENCH_KEY": load.key,
           "BENCH_KEY_PREFIX": load.key_prefix,
           "BENCH_HEADERS": "\n".join(f"{k}: {v}" for k, v in load.headers)}
    # One thread: wrk drives tens of thousands of requests/s from one core; a second
    # thread would only take CPU from what is measured.
    argv = ["wrk", "-t1", f"-c{load.connections}", f"-d{max(1, round(load.duration))}s",
            "--timeout", "10s", "-s", str(WRK_SCRIPT), load.url]
    out = subprocess.run(argv, env=env, capture_output=True, text=True,
                         timeout=load.duration + 30)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("BENCH_JSON ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stdout[-2000:]} {out.stderr[-2000:]}")
    raw = json.loads(line.split(" ", 1)[1])
    us = 1000.0
    return Summary(raw["requests"], raw["duration_us"] / 1e6, raw["p50_us"] / us, raw["p90_us"] / us,
                   raw["p99_us"] / us, raw["max_us"] / us,
                   {k: v for k, v in raw["errors"].items() if v})


def run_python(load: Load) -> Summary:
    argv = [sys.executable, __file__, "--url", load.url, "--connections", str(load.connections),
            "--duration", str(load.duration), "--body", load.body, "--key", load.key,
            "--key-prefix", load.key_prefix]
    for name, value in load.headers:
        argv += ["--header", f"{name}: {value}"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=load.duration + 60)
    if out.returncode != 0:
        raise RuntimeError(f"python load generator failed: {out.stderr[-2000:]}")
    return Summary(**json.loads(out.stdout))


# -- the Python generator (runs as its own process, with up to 2 worker processes) ---------

def _worker(load: Load, index: int, start_at: float) -> tuple[list[float], dict[str, int], float]:
    import aiohttp

    async def main() -> tuple[list[float], dict[str, int], float]:
        latencies: list[float] = []
        errors: dict[str, int] = {}
        headers = dict(load.headers)
        body = load.body.encode()
        connector = aiohttp.TCPConnector(limit=load.connections)
        async with aiohttp.ClientSession(connector=connector) as session:
            await asyncio.sleep(max(0.0, start_at - time.time()))
            began = time.perf_counter()
            stop = began + load.duration

            async def connection(c: int) -> None:
                n = 0
                while time.perf_counter() < stop:
                    n += 1
                    h = headers
                    if load.key:
                        h = {**headers, "Idempotency-Key": load.key}
                    elif load.key_prefix:
                        h = {**headers, "Idempotency-Key": f"{load.key_prefix}{index}.{c}-{n}"}
                    sent = time.perf_counter()
                    try:
                        async with session.post(load.url, data=body, headers=h) as resp:
                            await resp.read()
                            if resp.status >= 400:
                                errors["status"] = errors.get("status", 0) + 1
                                continue
                    except Exception as exc:  # noqa: BLE001 - counted, like wrk does
                        errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                        continue
                    latencies.append(time.perf_counter() - sent)

            await asyncio.gather(*(connection(c) for c in range(load.connections)))
            return latencies, errors, time.perf_counter() - began

    return run_on_uvloop(main)


def _python_main(load: Load) -> Summary:
    procs = min(2, load.connections)
    per = [load.connections // procs + (i < load.connections % procs) for i in range(procs)]
    start_at = time.time() + 0.5  # all workers begin together, after their imports
    with multiprocessing.get_context("spawn").Pool(procs) as pool:
        parts = pool.starmap(_worker, [(Load(load.url, n, load.duration, load.body, load.headers,
                                             load.key, load.key_prefix), i, start_at)
                                       for i, n in enumerate(per)])
    latencies = sorted(x for lat, _, _ in parts for x in lat)
    errors: dict[str, int] = {}
    for _, errs, _ in parts:
        for k, v in errs.items():
            errors[k] = errors.get(k, 0) + v
    seconds = max(s for _, _, s in parts)

    def pct(p: float) -> float:
        return latencies[min(len(latencies) - 1, int(p / 100 * len(latencies)))] * 1000 if latencies else 0.0
    return Summary(len(latencies), seconds, pct(50), pct(90), pct(99), pct(100), errors)


def main() -> None:
    parser = argparse.ArgumentParser(description="the Python load generator (wrk's stand-in)")
    parser.add_argument("--url", required=True)
    parser.add_argument("--connections", type=int, default=1)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--body", default="")
    parser.add_argument("--header", action="append", default=[])
    parser.add_argument("--key", default="")
    parser.add_argument("--key-prefix", default="")
    args = parser.parse_args()
    headers = tuple((n.strip(), v.strip()) for n, _, v in (h.partition(":") for h in args.header))
    summary = _python_main(Load(args.url, args.connections, args.duration, args.body, headers,
                                args.key, args.key_prefix))
    json.dump(summary.__dict__, sys.stdout)


if __name__ == "__main__":
    main()
