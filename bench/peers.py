"""Peers side by side: LiteLLM's proxy and the Portkey gateway next to idemproxy.

    python bench/peers.py                  # installs the peers on first use, then measures:
                                           # about 5 minutes (3 rounds of 3 s per measurement)
    python bench/peers.py --install        # only install (LiteLLM from PyPI, Portkey from npm)
    python bench/peers.py --rounds 1 --duration 2     # a quick look (about 2 minutes)

One run, one provider (nginx's fixed chat completion, bench/nginx.py), one load (wrk, the same
POST body as bench/run.py), every server started once by this script, one process each:

- the plain aiohttp pass-through (bench/baseline.py), the yardstick;
- idemproxy on SQLite: passthrough (``Idem-Policy: passthrough``), replay (the same
  ``Idempotency-Key`` every time: its cache hit) and record (a fresh key per request);
- LiteLLM's proxy: passthrough, and cache hit (``cache: local``, the same body every time);
- the Portkey gateway: passthrough (its open-source build has no cache store).

The peers are installed into a folder of their own outside the repository (bench/peer_servers.py).
Before measuring, each mode is probed: it must answer 200, forward exactly one call per request
(or none, for a cache hit, after one call that fills it), and its answer is compared with the
provider's. Then ``--rounds`` rounds measure every mode at 1 and at 32 connections, in turn, so a
change in the shared machine's load touches every row alike; the table gives each figure's
median and its range over the rounds. Every measurement counts the calls that reached nginx,
the CPU time of the server's whole process group, and what else kept the machine busy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import loadgen  # noqa: E402
import processes  # noqa: E402
import nginx  # noqa: E402
import peer_servers  # noqa: E402
from processes import (BENCH, BenchError, Processes, Server, cpu_seconds, group_members,  # noqa: E402
                       http, machine_busy_seconds, make_store)
from run import BODY, HEADERS  # noqa: E402

LOW, HIGH = 1, 32  # connections
FIRST_WARMUP_S = 3.0  # per server, once, at 32 connections: JIT (node) and lazy imports (LiteLLM)
MAX_WINDOW_S = 10.0   # the longest a measurement is stretched for a slow server
QUIESCE_S = 15.0      # the longest to wait for a server to finish what a load left in flight


@dataclass(frozen=True)
class Case:
    proxy: str
    mode: str
    server: Server
    path: str
    headers: tuple[tuple[str, str], ...]
    key: str = "none"       # Idempotency-Key: none, same (every request) or fresh (per request)
    hit: bool = False       # answered without calling the provider?

    @property
    def url(self) -> str:
        return self.server.url + self.path


class Bench:
    """Loads, probes and measurements against one provider, whose calls it counts."""

    def __init__(self, args: argparse.Namespace, provider: Server):
        self.args, self.provider = args, provider
        self.counter = nginx.CallCounter()
        self.tag = uuid.uuid4().hex[:8]
        self.serial = 0  # fresh keys stay fresh across measurements

    def upstream_calls(self) -> int:
        status, _, body = http("GET", self.provider.url + "/_calls")
        if status != 200:
            raise BenchError(f"nginx /_calls answered {status}")
        return self.counter.count(body.decode())

    def load(self, case: Case, connections: int, duration: float) -> loadgen.Load:
        self.serial += 1
        return loadgen.Load(case.url, connections, duration, BODY, case.headers,
                            key=f"peers-{self.tag}-replay" if case.key == "same" else "",
                            key_prefix=f"peers-{self.tag}-{self.serial}-" if case.key == "fresh" else "")

    def probe(self, case: Case) -> dict:
        """One request (two for a cache hit: the first fills it); what came back, and the calls."""
        headers = dict(case.headers)
        if case.key != "none":
            headers["Idempotency-Key"] = f"peers-{self.tag}-{'replay' if case.key == 'same' else 'probe'}"
        if case.hit:
            http("POST", case.url, BODY.encode(), headers)
            time.sleep(0.2)
        before = self.upstream_calls()
        status, got, body = http("POST", case.url, BODY.encode(), headers)
        time.sleep(0.2)
        calls = self.upstream_calls() - before
        problems = []
        if status != 200:
            problems.append(f"answered {status}: {body[:300]!r}")
        if calls != (0 if case.hit else 1):
            problems.append(f"{calls} upstream calls for one request")
        if problems:
            raise BenchError(f"{case.proxy} {case.mode} probe: " + "; ".join(problems))
        return {"answer": compare_answer(body), "evidence": hit_evidence(got) if case.hit else ""}

    def measure(self, case: Case, connections: int) -> dict:
        a = self.args
        warm = loadgen.run(a.loadgen, self.load(case, connections, a.warmup))
        # A window of at least ten of the warm-up's median latencies: a slow server's first
        # answers at 32 connections come late, and a short window would hold little else.
        duration = min(max(a.duration, 10 * warm.p50_ms / 1000), MAX_WINDOW_S)
        self.quiesce(case.server)  # what the warm-up left in flight is done
        calls_before, cpu_before = self.upstream_calls(), self._cpu(case.server)
        s = loadgen.run(a.loadgen, self.load(case, connections, duration))
        cpu_at_end, members = self._cpu(case.server), group_members(case.server)
        self.quiesce(case.server)
        calls, cpu_after = self.upstream_calls() - calls_before, self._cpu(case.server)
        # Closed loop: wrk stops with one request in flight on each connection, which the
        # server still answers; so it handles between the completed requests and one more
        # per connection, and calls the provider once for each (none for a cache hit).
        expected = (0, 0) if case.hit else (s.requests, s.requests + connections)
        handled = calls if not case.hit else s.requests + connections
        window = {k: cpu_at_end[k] - cpu_before[k] for k in cpu_before}
        m = {"proxy": case.proxy, "mode": case.mode, "connections": connections,
             "rps": round(s.rps, 1), "p50_ms": round(s.p50_ms, 3), "p99_ms": round(s.p99_ms, 3),
             "requests": s.requests, "seconds": round(s.seconds, 3), "errors": s.errors,
             "upstream_calls": calls, "calls_ok": expected[0] <= calls <= expected[1],
             # everything the server spent on the requests it handled, their tail included
             "cpu_us_per_request": round((cpu_after["server"] - cpu_before["server"]) / max(handled, 1) * 1e6, 1),
             "provider_cpu_us_per_request": round(window["provider"] / max(s.requests, 1) * 1e6, 1),
             # cores kept busy by neither the server, nginx nor wrk: others' work on the machine
             "other_cores_busy": round(max(0.0, window["machine"] - window["server"] - window["provider"]
                                           - window["loadgen"]) / max(s.seconds, 1e-9), 2),
             "processes": members[0], "threads": members[1]}
        flag = "" if m["calls_ok"] and not s.errors else f"  !! errors={s.errors} upstream_calls={calls}"
        print(f"  {case.proxy:24} {case.mode:22} c{connections:<3}{m['rps']:8.0f} req/s  p50 {m['p50_ms']:8.3f} ms"
              f"  cpu/req {m['cpu_us_per_request']:7.0f} us  upstream calls {calls:6}  "
              f"others {m['other_cores_busy']} cores{flag}", flush=True)
        return m

    def quiesce(self, server: Server) -> None:
        """Wait until the server has finished what it was given: no more calls reach the
        provider and it spends (almost) no CPU; at most QUIESCE_S."""
        deadline = time.monotonic() + QUIESCE_S
        calls, cpu = self.upstream_calls(), cpu_seconds(server) or 0.0
        while time.monotonic() < deadline:
            time.sleep(0.25)
            now_calls, now_cpu = self.upstream_calls(), cpu_seconds(server) or 0.0
            if now_calls == calls and now_cpu - cpu < 0.01:
                return
            calls, cpu = now_calls, now_cpu

    def _cpu(self, server: Server) -> dict[str, float]:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # wrk: the only child reaped meanwhile
        return {"server": cpu_seconds(server) or 0.0, "provider": cpu_seconds(self.provider) or 0.0,
                "loadgen": usage.ru_utime + usage.ru_stime, "machine": machine_busy_seconds() or 0.0}


def compare_answer(body: bytes) -> str:
    """How an answer differs from the provider's completion (nginx.COMPLETION)."""
    if body == nginx.COMPLETION.encode():
        return "identical bytes"
    try:
        got = json.loads(body)
    except ValueError:
        return "not JSON"
    added, dropped, changed = _diff(json.loads(nginx.COMPLETION), got, "")
    if not (added or dropped or changed):
        return "same JSON, other bytes"
    parts = [f"{what} {', '.join(sorted(set(names)))}" for what, names in
             (("adds", added), ("drops", dropped), ("changes", changed)) if names]
    return "JSON rewritten: " + "; ".join(parts)


def _diff(want: object, got: object, where: str) -> tuple[list[str], list[str], list[str]]:
    """Fields added, dropped and changed, by path (``choices.0.message.refusal``)."""
    if isinstance(want, dict) and isinstance(got, dict):
        added = [f"{where}{k}" for k in got if k not in want]
        dropped = [f"{where}{k}" for k in want if k not in got]
        changed: list[str] = []
        for k in want.keys() & got.keys():
            a, d, c = _diff(want[k], got[k], f"{where}{k}.")
            added, dropped, changed = added + a, dropped + d, changed + c
        return added, dropped, changed
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        found: tuple[list[str], list[str], list[str]] = ([], [], [])
        for i, (w, g) in enumerate(zip(want, got)):
            for mine, theirs in zip(found, _diff(w, g, f"{where}{i}.")):
                mine.extend(theirs)
        return found
    return [], [], ([] if want == got else [where.rstrip(".")])


def hit_evidence(headers: dict[str, str]) -> str:
    """What the answer itself says about coming from a cache (the call count is the proof)."""
    lower = {k.lower(): v for k, v in headers.items()}
    for name in ("idempotent-replayed", "x-litellm-cache-key", "x-portkey-cache-status"):
        if name in lower:
            return f"{name}: {lower[name][:16]}"
    return "no header says so"


def start(args: argparse.Namespace, procs: Processes, provider: Server) -> list[Case]:
    """Every server, started once; the modes measured on each."""
    peers = Path(args.peers_dir)
    chat = nginx.CHAT_PATH
    base = procs.baseline(provider.url)
    store_url, _ = make_store("sqlite", procs.workdir, "", "")  # a file in the temporary folder
    idem = procs.idemproxy("idemproxy-sqlite", provider.url, store_url, 1)
    lite = peer_servers.litellm(procs, peers, provider.url, cache=False)
    lite_cache = peer_servers.litellm(procs, peers, provider.url, cache=True)
    portkey = peer_servers.portkey(procs, peers)
    lite_headers = peer_servers.litellm_headers(HEADERS[0])
    return [
        Case("baseline (plain aiohttp)", "passthrough", base, chat, HEADERS),
        Case("idemproxy (sqlite)", "passthrough", idem, "/openai" + chat, HEADERS + (("Idem-Policy", "passthrough"),)),
        Case("idemproxy (sqlite)", "replay (cache hit)", idem, "/openai" + chat, HEADERS, key="same", hit=True),
        Case("idemproxy (sqlite)", "record (fresh key)", idem, "/openai" + chat, HEADERS, key="fresh"),
        Case("LiteLLM proxy", "passthrough", lite, chat, lite_headers),
        Case("LiteLLM proxy", "cache hit (local)", lite_cache, chat, lite_headers, hit=True),
        Case("Portkey gateway", "passthrough", portkey, chat, HEADERS + peer_servers.portkey_headers(provider.url)),
    ]


def summarize(cases: list[Case], measurements: list[dict], checks: dict[str, dict]) -> list[dict]:
    """One row per mode: medians over the rounds and their range; ratios to the same round's baseline."""
    def runs(case: Case, c: int) -> list[dict]:
        return [m for m in measurements if (m["proxy"], m["mode"], m["connections"]) == (case.proxy, case.mode, c)]
    base = cases[0]
    base_rps, base_p50 = [m["rps"] for m in runs(base, HIGH)], [m["p50_ms"] for m in runs(base, LOW)]
    base_cpu = [m["cpu_us_per_request"] for m in runs(base, HIGH)]
    rows = []
    for case in cases:
        high, low = runs(case, HIGH), runs(case, LOW)
        rps = [m["rps"] for m in high]
        added = [m["p50_ms"] - b for m, b in zip(low, base_p50)]
        problems = [f"c{m['connections']}: errors {m['errors']}" for m in high + low if m["errors"]]
        problems += [f"c{m['connections']}: {m['upstream_calls']} upstream calls for {m['requests']} requests"
                     for m in high + low if not m["calls_ok"]]
        rows.append({
            "proxy": case.proxy, "mode": case.mode, "hit": case.hit,
            "rps_c32": _spread(rps), "ratio_c32": _spread([r / b for r, b in zip(rps, base_rps)], 2),
            "p50_ms_c1": _spread([m["p50_ms"] for m in low], 3), "added_p50_ms_c1": _spread(added, 3),
            "p99_ms_c32": _spread([m["p99_ms"] for m in high], 3),
            "cpu_us_c32": _spread([m["cpu_us_per_request"] for m in high]),
            "cpu_ratio_c32": _spread([m["cpu_us_per_request"] / b for m, b in zip(high, base_cpu)], 1),
            "cpu_us_c1": _spread([m["cpu_us_per_request"] for m in low]),
            "upstream_calls_c32": sum(m["upstream_calls"] for m in high),
            "requests_c32": sum(m["requests"] for m in high),
            "processes": max(m["processes"] for m in high), "threads": max(m["threads"] for m in high),
            "others_cores_busy": _spread([m["other_cores_busy"] for m in high + low], 2),
            "problems": problems, **checks[f"{case.proxy} / {case.mode}"]})
    return rows


def _spread(values: list[float], digits: int = 1) -> dict:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}


def markdown(rows: list[dict], meta: dict) -> str:
    def fig(s: dict, fmt: str, sign: str = "") -> str:
        text = f"{s['median']:{sign}{fmt}}"
        return text if s["min"] == s["max"] else f"{text} ({s['min']:{sign}{fmt}} – {s['max']:{sign}{fmt}})"
    lines = ["| proxy | mode | req/s @32 | × baseline @32 | p50 @1 | added p50 @1 | CPU µs/req @32 "
             "| CPU × baseline | upstream calls @32 | processes / threads | answer |",
             "|---|---|--:|--:|--:|--:|--:|--:|---|---|---|"]
    notes = []
    for r in rows:
        calls = r["upstream_calls_c32"]
        calls_text = ("none" if calls == 0 else f"{calls} (!!)") if r["hit"] else \
            f"{calls:,} for {r['requests_c32']:,} answers"
        added = "–" if r is rows[0] else f"{fig(r['added_p50_ms_c1'], '.2f', '+')} ms"
        answer, _, detail = r["answer"].partition(": ")
        if detail:
            notes.append(f"{r['proxy']}, {r['mode']}: {answer}: {detail}.")
        lines.append(
            f"| {r['proxy']} | {r['mode']}{' !!' if r['problems'] else ''} | {fig(r['rps_c32'], ',.0f')} "
            f"| {fig(r['ratio_c32'], '.2f')} | {fig(r['p50_ms_c1'], '.2f')} ms | {added} "
            f"| {fig(r['cpu_us_c32'], ',.0f')} | {fig(r['cpu_ratio_c32'], ',.1f')} | {calls_text} "
            f"| {r['processes']} / {r['threads']} | {answer} |")
    lines.append("| Portkey gateway | cache hit | – | – | – | – | – | – | – | – "
                 "| no cache store in the open-source build |")
    lines += [""] + notes if notes else []
    rounds, peers = meta["rounds"], meta["peers"]
    lines.append(
        f"\nMedian over {rounds} round{'s' * (rounds > 1)} (range in brackets); {meta['duration_s']:g} s per "
        f"measurement (for a slow server, at least ten times its warm-up's median latency, at most "
        f"{MAX_WINDOW_S:g} s) after {meta['warmup_s']:g} s of warm-up; wrk; "
        f"LiteLLM {peers['litellm']} (Python {meta['python']}), "
        f"Portkey gateway {peers['portkey']} (Node {meta['node']}); {meta['started']}, git {meta['git']}; "
        f"load average {meta['loadavg_start'][0]:.2f} at the start, {meta['loadavg_end'][0]:.2f} at the end; "
        f"{meta['elapsed_s']:.0f} s in all.")
    noisy = [r for r in rows if r["others_cores_busy"]["max"] > 0.3]
    if noisy:
        lines.append(f"!! other processes kept up to {max(r['others_cores_busy']['max'] for r in noisy):.1f} "
                     "cores busy during these measurements: re-run on a quiet machine.")
    for r in rows:
        for p in r["problems"]:
            lines.append(f"!! {r['proxy']} {r['mode']}: {p}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--install", action="store_true", help="install the peers and stop")
    p.add_argument("--peers-dir", default=str(peer_servers.default_dir()),
                   help="where the peers are installed (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="measurements of every mode, in turn (default 3)")
    p.add_argument("--duration", type=float, default=3.0, help="seconds per measurement (default 3)")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of warm-up before each (default 1)")
    p.add_argument("--loadgen", choices=("auto", "wrk", "python"), default="wrk")
    p.add_argument("--out", default=str(BENCH / "results" / "peers.json"))
    args = p.parse_args(argv)
    if not nginx.executable():
        p.error(nginx.INSTALL_HINT)
    try:
        args.loadgen = loadgen.available(args.loadgen)
    except RuntimeError as exc:
        p.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    processes.stop_on_signals()
    peer_servers.install(Path(args.peers_dir))
    if args.install:
        return 0
    meta = {"started": time.strftime("%Y-%m-%d %H:%M %Z"), "rounds": args.rounds, "duration_s": args.duration,
            "warmup_s": args.warmup, "loadgen": args.loadgen, "cpus": os.cpu_count(),
            "loadavg_start": os.getloadavg(), "git": processes.git_head(), "peers": peer_servers.installed(Path(args.peers_dir)),
            **peer_servers.runtimes(Path(args.peers_dir)), "platform": platform.platform()}
    began = time.monotonic()
    measurements: list[dict] = []
    checks: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="idem-peers-") as tmp, Processes(Path(tmp)) as procs:
        provider = procs.nginx()
        bench = Bench(args, provider)
        cases = start(args, procs, provider)
        for case in cases:
            checks[f"{case.proxy} / {case.mode}"] = bench.probe(case)
        for first in {c.server.name: c for c in reversed(cases)}.values():  # each server's first mode
            loadgen.run(args.loadgen, bench.load(first, HIGH, FIRST_WARMUP_S))
            bench.quiesce(first.server)
        for n in range(args.rounds):
            print(f"round {n + 1} of {args.rounds} (load average {os.getloadavg()[0]:.2f})", flush=True)
            for case in cases:
                for connections in (LOW, HIGH):
                    measurements.append(bench.measure(case, connections))
    meta.update(loadavg_end=os.getloadavg(), elapsed_s=round(time.monotonic() - began, 1))
    rows = summarize(cases, measurements, checks)
    table = markdown(rows, meta)
    print("\n" + table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows, "measurements": measurements}, indent=2) + "\n")
    print(f"\nwritten: {out}")
    return 1 if any(r["problems"] for r in rows) else 0



if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as exc:
        print(f"peers: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
