"""Benchmark idemproxy against a plain aiohttp pass-through proxy, in one command.

    python bench/run.py [--duration 4] [--stores sqlite,postgres,redis] [--workers 1,2]
                        [--out bench/results/latest.json] [--loadgen auto|wrk|python]
                        [--scenarios ...] [--profile DIR]

Starts the fake provider, the baseline proxy (bench/baseline.py) and ``idemproxy serve``,
each in a process of its own, and measures requests/s and p50/p99 latency at 1 and 32
connections, with a load generator in yet another process. Prints a markdown table and
writes the figures as JSON. bench/README.md says how to read them.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))

import loadgen  # noqa: E402
import processes  # noqa: E402
import nginx  # noqa: E402
import profile_summary  # noqa: E402
import report  # noqa: E402
from processes import (REPO, BenchError, Processes, Server, cpu_seconds, http,  # noqa: E402
                       check_store, machine_busy_seconds, make_store, store_server_seconds)

LOW, HIGH = 1, 32  # connections
BODY = json.dumps({"model": "gpt-bench", "temperature": 0,
                   "messages": [{"role": "system", "content": "You are terse."},
                                {"role": "user", "content": "Say hello in three words."}]})
# A credential, so that idemproxy derives a tenant (an HMAC) as it would in production.
HEADERS = (("Content-Type", "application/json"), ("Authorization", "Bearer sk-bench-not-a-real-key"))
RUN = "/runs/bench-run/epochs/0"
# A 2026-07-28 tools/call to examples/mcp_tool_server.py (upstream `mcp`). The probe records it
# under another JSON-RPC id, so every replay is readdressed to the caller's id.
MCP_CALL = {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
            "params": {"name": "send_email", "arguments": {"to": "bench@example.com", "subject": "hi"},
                       "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                                 "io.modelcontextprotocol/clientCapabilities": {}}}}
MCP_BODY = json.dumps(MCP_CALL)
MCP_HEADERS = (("Accept", "application/json, text/event-stream"), ("MCP-Protocol-Version", "2026-07-28"),
               ("Mcp-Method", "tools/call"), ("Mcp-Name", "send_email"))
PROFILE_HZ = 250


@dataclass(frozen=True)
class Scenario:
    name: str
    path: str                  # below the server's URL; {chat} is the provider's chat path
    policy: str | None = None  # Idem-Policy header
    key: str = "none"          # Idempotency-Key: none, same (every request) or fresh (per request)
    upstream: bool = True      # does each request reach the provider?
    body: str = BODY
    headers: tuple[tuple[str, str], ...] = ()


SCENARIOS = {s.name: s for s in (
    Scenario("baseline", "{chat}"),
    Scenario("passthrough", "/openai{chat}", policy="passthrough"),
    Scenario("replay", "/openai{chat}", key="same", upstream=False),
    Scenario("record", "/openai{chat}", key="fresh"),
    Scenario("run-passthrough", RUN + "/openai{chat}", policy="passthrough"),
    Scenario("run-record", RUN + "/openai{chat}", key="fresh"),
    # Not in the default set: a run with no Idempotency-Key, so every request gets a
    # derived key (run, fingerprint, n); n costs one more store write per request.
    Scenario("run-derived", RUN + "/openai{chat}"),
    # An MCP tools/call replayed from the journal: to be read next to `replay`.
    Scenario("mcp-replay", "/mcp/mcp", key="same", upstream=False, body=MCP_BODY, headers=MCP_HEADERS),
)}
DEFAULT_SCENARIOS = ("passthrough", "replay", "record", "run-passthrough", "run-record")
# provider -> the path of its chat completion: nginx answers the real one (bench/nginx.py),
# the Python fake provider its cheap /small (it also streams, which nginx's fixed body cannot)
CHAT_PATHS = {"nginx": nginx.CHAT_PATH, "python": "/small"}


@dataclass
class Bench:
    args: argparse.Namespace
    kind: str          # load generator: wrk or python
    procs: Processes
    provider: Server
    mcp: Server | None = None  # the MCP tool server, for mcp-* scenarios
    counter: nginx.CallCounter = dataclasses.field(default_factory=nginx.CallCounter)
    tag: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:8])
    serial: Iterator[int] = dataclasses.field(default_factory=itertools.count)  # fresh keys stay fresh

    def upstream_calls(self) -> int:
        status, _, body = http("GET", self.provider.url + "/_calls")
        if status != 200:
            raise BenchError(f"provider /_calls answered {status}")
        if self.args.provider == "nginx":
            return self.counter.count(body.decode())
        return json.loads(body).get("small", 0)

    def path(self, scenario: Scenario) -> str:
        return scenario.path.format(chat=CHAT_PATHS[self.args.provider])

    def load(self, server: Server, scenario: Scenario, connections: int, duration: float) -> loadgen.Load:
        headers = HEADERS + scenario.headers + ((("Idem-Policy", scenario.policy),) if scenario.policy else ())
        return loadgen.Load(
            server.url + self.path(scenario), connections, duration, scenario.body, headers,
            key=self.replay_key(server) if scenario.key == "same" else "",
            key_prefix=f"bench-{self.tag}-{next(self.serial)}-" if scenario.key == "fresh" else "")

    def replay_key(self, server: Server) -> str:
        return f"bench-{self.tag}-{server.name}-replay"

    def cpu(self, server: Server) -> dict[str, float | None]:
        """CPU seconds used so far by the server measured, the provider, the load generator
        (the only child reaped during a measurement) and the whole machine."""
        return {"server": cpu_seconds(server), "provider": cpu_seconds(self.provider),
                "loadgen": _children_cpu(), "store_server": store_server_seconds(),
                "machine": machine_busy_seconds()}

    def measure(self, store: str, workers: int, server: Server, scenario: Scenario,
                connections: int) -> dict:
        loadgen.run(self.kind, self.load(server, scenario, connections, self.args.warmup))
        time.sleep(0.2)  # let calls the warm-up left in flight reach the provider
        calls_before = self.upstream_calls()
        profiler = self.start_profiler(server, scenario, store, workers, connections)
        cpu_before = self.cpu(server)
        summary = loadgen.run(self.kind, self.load(server, scenario, connections, self.args.duration))
        cpu_after = self.cpu(server)
        profile = self.finish_profiler(profiler, summary.requests)
        time.sleep(0.2)
        calls = self.upstream_calls() - calls_before
        # Closed loop: every completed request made its call, plus at most one call per
        # connection whose answer came after the load generator stopped counting.
        expected = (summary.requests, summary.requests + connections) if scenario.upstream else (0, 0)
        used = {k: _delta(cpu_before[k], cpu_after[k]) for k in cpu_before}
        result = {
            "store": store, "workers": workers, "scenario": scenario.name, "connections": connections,
            "rps": round(summary.rps, 1), "p50_ms": round(summary.p50_ms, 3),
            "p90_ms": round(summary.p90_ms, 3), "p99_ms": round(summary.p99_ms, 3),
            "max_ms": round(summary.max_ms, 3), "requests": summary.requests,
            "seconds": round(summary.seconds, 3), "errors": summary.errors,
            "upstream_calls": calls, "calls_ok": expected[0] <= calls <= expected[1],
            "cpu_us_per_request": {k: _per(used[k], summary.requests / 1e6, 1)
                                   for k in ("server", "provider", "loadgen", "store_server")},
            "machine_cores_busy": _per(used["machine"], summary.seconds, 2),
            # Cores busy with none of the above: someone else's work, competing with ours.
            "other_cores_busy": _per(_others(used), summary.seconds, 2),
            "profiled": profile is not None,
        }
        if profile:
            result["profile"] = profile
        self.show(result, expected)
        return result

    @staticmethod
    def show(r: dict, expected: tuple[int, int]) -> None:
        cpu = {k: v or 0 for k, v in r["cpu_us_per_request"].items()}
        flag = "" if r["calls_ok"] and not r["errors"] else \
            f"  !! errors={r['errors']} upstream_calls={r['upstream_calls']} expected {expected}"
        print(f"  {r['store']:8} w{r['workers']} {r['scenario']:16} c{r['connections']:<3} {r['rps']:8.0f} req/s  "
              f"p50 {r['p50_ms']:6.3f} ms  p99 {r['p99_ms']:7.3f} ms  cpu/req {cpu['server']:5.0f} us "
              f"(provider {cpu['provider']:4.0f}, loadgen {cpu['loadgen']:3.0f}, store {cpu['store_server']:4.0f}); "
              f"others {r['other_cores_busy']} cores{flag}", flush=True)

    # -- profiling (optional: py-spy samples the idemproxy process under load) --------------

    def start_profiler(self, server: Server, scenario: Scenario, store: str, workers: int,
                       connections: int):
        if not self.args.profile or connections != HIGH:
            return None
        out = Path(self.args.profile) / f"{store}-w{workers}-{scenario.name}.collapsed"
        out.parent.mkdir(parents=True, exist_ok=True)
        argv = [self.args.py_spy, "record", "--pid", str(server.popen.pid), "--rate", str(PROFILE_HZ),
                "--format", "raw",
                "--duration", str(max(1, round(self.args.duration) - 1)), "--output", str(out),
                "--nonblocking"] + (["--subprocesses"] if workers > 1 else [])
        return out, subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def finish_profiler(self, profiler, requests: int) -> str | None:
        """Wait for py-spy; summarize its samples per request (those in its shorter window)."""
        if profiler is None:
            return None
        out, popen = profiler
        try:
            _, err = popen.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()
            return None
        if popen.returncode != 0 or not out.exists():
            print(f"  py-spy failed: {err.decode(errors='replace')[-500:]}", file=sys.stderr)
            return None
        summary = out.with_suffix(".txt")
        in_window = round(requests * (self.args.duration - 1) / self.args.duration)
        summary.write_text(profile_summary.summarize(out, in_window, PROFILE_HZ))
        return str(summary)


def _others(used: dict[str, float | None]) -> float | None:
    if used["machine"] is None or any(v is None for v in used.values()):
        return None
    return max(0.0, used["machine"] - sum(v for k, v in used.items() if k != "machine" and v))


def _delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


def _per(value: float | None, divisor: float, digits: int) -> float | None:
    return None if value is None else round(value / max(divisor, 1e-9), digits)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def probe(bench: Bench, server: Server) -> None:
    """Before measuring: idemproxy passes through, records and replays as configured."""
    def post(path: str, extra: dict[str, str]) -> tuple[int, dict[str, str]]:
        status, headers, _ = http("POST", server.url + path, BODY.encode(), {**dict(HEADERS), **extra})
        return status, headers

    before = bench.upstream_calls()
    chat = bench.path(SCENARIOS["passthrough"])
    status, headers = post(chat, {"Idem-Policy": "passthrough"})
    if status != 200 or "Idempotent-Replayed" in headers:
        raise BenchError(f"passthrough probe: {status} {headers}")
    key = bench.replay_key(server)
    first, second = post(chat, {"Idempotency-Key": key}), post(chat, {"Idempotency-Key": key})
    if (first[0], first[1].get("Idempotent-Replayed"), second[0], second[1].get("Idempotent-Replayed")) \
            != (200, "false", 200, "true"):
        raise BenchError(f"record/replay probe: {first} then {second}")
    if bench.upstream_calls() - before != 2:
        raise BenchError("probe: the provider did not see exactly the two calls expected")
    if "mcp-replay" in bench.args.scenarios:
        probe_mcp(bench, server)


def probe_mcp(bench: Bench, server: Server) -> None:
    """The MCP tools/call is recorded once (under id "probe"), then replayed under the caller's id."""
    headers = {**dict(HEADERS), **dict(MCP_HEADERS), "Idempotency-Key": bench.replay_key(server)}
    answers = []
    for request_id in ("probe", 7):
        body = json.dumps({**MCP_CALL, "id": request_id}).encode()
        status, got, answer = http("POST", server.url + "/mcp/mcp", body, headers)
        answers.append((status, got.get("Idempotent-Replayed"), json.loads(answer).get("id")))
    if answers != [(200, "false", "probe"), (200, "true", 7)]:
        raise BenchError(f"MCP record/replay probe: {answers}")


def run_store(bench: Bench, store: str, baseline: Server, results: list[dict]) -> None:
    a = bench.args
    check_store(store, a.postgres_url, a.redis_url)
    for connections in (LOW, HIGH):  # a baseline next to each store's figures
        results.append(bench.measure(store, 0, baseline, SCENARIOS["baseline"], connections))
    for workers in a.workers:
        if workers > 1:  # the yardstick: a plain proxy as N processes on this machine
            plain = bench.procs.baseline(bench.provider.url, workers)
            try:
                results.append(bench.measure(store, workers, plain, SCENARIOS["baseline"], HIGH))
            finally:
                bench.procs.stop(plain)
        url, drop = make_store(store, bench.procs.workdir, a.postgres_url, a.redis_url)
        server = None
        try:
            server = bench.procs.idemproxy(f"idemproxy-{store}-w{workers}", bench.provider.url, url, workers,
                                           mcp=bench.mcp.url if bench.mcp else None)
            probe(bench, server)
            for round_ in range(a.rounds):
                for name in a.scenarios:
                    if workers == 1 and round_ == 0:
                        results.append(bench.measure(store, workers, server, SCENARIOS[name], LOW))
                    paired = None
                    if workers == 1:  # the yardstick measured just before, so a change of load touches both
                        paired = bench.measure(store, 0, baseline, SCENARIOS["baseline"], HIGH)
                        results.append(paired)
                    result = bench.measure(store, workers, server, SCENARIOS[name], HIGH)
                    if paired is not None:
                        result["paired_baseline_rps"] = paired["rps"]
                    results.append(result)
        finally:
            if server is not None:
                bench.procs.stop(server)
            drop()
    # Again after the store's rows: ratios use the mean, and a drift says the machine's
    # load changed meanwhile (other work on a shared machine), so they are unreliable.
    results.append(bench.measure(store, 0, baseline, SCENARIOS["baseline"], HIGH))


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=4.0, help="seconds per measurement (default 4)")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of warm-up before each (default 1)")
    p.add_argument("--stores", type=_csv, default=["sqlite", "postgres", "redis"])
    p.add_argument("--workers", type=lambda v: [int(x) for x in _csv(v)], default=[1],
                   help="idemproxy worker counts, e.g. 1,2 (2 is measured at 32 connections)")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every scenario at 32 connections this many times (ratios: their median)")
    p.add_argument("--scenarios", type=_csv, default=list(DEFAULT_SCENARIOS),
                   help=f"from: {', '.join(n for n in SCENARIOS if n != 'baseline')}")
    p.add_argument("--loadgen", choices=("auto", "wrk", "python"), default="auto")
    p.add_argument("--provider", choices=("auto", "nginx", "python"), default="auto",
                   help="upstream: nginx's fixed completion (auto when installed) or the Python fake provider")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "latest.json"))
    p.add_argument("--postgres-url", default=os.environ.get(
        "IDEMPROXY_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres"))
    p.add_argument("--redis-url", default=os.environ.get("IDEMPROXY_TEST_REDIS", "redis://127.0.0.1:6379/0"))
    p.add_argument("--profile", metavar="DIR",
                   help="sample idemproxy with py-spy at 32 connections; figures are then disturbed")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = p.parse_args(argv)
    unknown = [s for s in args.scenarios if s not in SCENARIOS or s == "baseline"]
    if unknown:
        p.error(f"unknown scenario(s): {', '.join(unknown)}")
    if args.profile:
        args.py_spy = processes.py_spy()
        if args.py_spy is None:
            p.error("--profile needs py-spy (pip install py-spy)")
    if args.provider == "auto":
        args.provider = "nginx" if nginx.executable() else "python"
        if args.provider == "python":
            print(f"note: {nginx.INSTALL_HINT}; measuring in front of the Python provider", file=sys.stderr)
    elif args.provider == "nginx" and not nginx.executable():
        p.error(nginx.INSTALL_HINT)
    if 1 not in args.workers:
        args.workers.insert(0, 1)  # ratios for more workers are to one worker
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    processes.stop_on_signals()
    kind = loadgen.available(args.loadgen)
    meta = {**processes.run_facts(kind, args.duration), "warmup_s": args.warmup, "provider": args.provider}
    results: list[dict] = []
    errors: dict[str, str] = {}
    began = time.monotonic()
    meta["complete"] = False
    print(f"idemproxy benchmark: stores {','.join(args.stores)}, workers {args.workers}, "
          f"{args.duration:g}s per measurement, load generator {kind}, provider {args.provider}", flush=True)
    try:
        with tempfile.TemporaryDirectory(prefix="idem-bench-") as tmp, Processes(Path(tmp)) as procs:
            provider = procs.nginx() if args.provider == "nginx" else procs.provider()
            baseline = procs.baseline(provider.url)
            mcp = procs.mcp_tools() if any(s.startswith("mcp-") for s in args.scenarios) else None
            bench = Bench(args, kind, procs, provider, mcp)
            for store in args.stores:
                try:
                    run_store(bench, store, baseline, results)
                except BenchError as exc:
                    errors[store] = str(exc)
                    print(f"  {store}: FAILED: {exc}", file=sys.stderr, flush=True)
        meta["complete"] = True
    finally:
        meta.update(loadavg_end=os.getloadavg(), elapsed_s=round(time.monotonic() - began, 1))
        rows = report.rows(results)
        doc = {"meta": meta, "errors": errors, "rows": rows, "measurements": results}
        if results:
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(doc, indent=2) + "\n")
            print()
            print(report.markdown(rows, meta, errors))
            print(f"\nwritten: {out}")
    missed = [r for r in rows if r["ok"] is False]
    return 1 if errors or (args.strict and missed) else 0



if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
