"""Peers side by side: LiteLLM's proxy and the Portkey gateway next to idemproxy (issue 13).

    python bench/peers.py --install      # LiteLLM into bench/peers/litellm (a venv), Portkey into
                                         # bench/peers/portkey (npm); both folders are ignored by git
    python bench/peers.py [--duration 4] [--out bench/results/peers.json]

One run, one provider (nginx's fixed chat completion, bench/nginx.py), one load (wrk, the same
POST as bench/run.py): the plain aiohttp pass-through (the baseline), idemproxy on SQLite, LiteLLM's
proxy and the Portkey gateway, each in passthrough and in its cache-hit mode (idemproxy: a replay),
at 32 connections (requests/s) and at 1 connection (p50 added to the baseline's). Every measurement
counts the calls that reached nginx: a cache hit must make none.

The Portkey gateway's open-source build has no cache store (its cache lookups answer DISABLED):
its cache mode is reported as not available.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import loadgen  # noqa: E402
import nginx  # noqa: E402
from processes import BENCH, BenchError, Processes, Server, free_port, http, make_store  # noqa: E402
from run import BODY, HEADERS  # noqa: E402

PEERS = BENCH / "peers"
# Pinned: what was measured. LiteLLM 1.107.0 was a compromised release (withdrawn from PyPI);
# 1.110.x needs a litellm-proxy package PyPI does not have.
LITELLM = "litellm[proxy]==1.106.12"
PORTKEY = "@portkey-ai/gateway@1.15.2"
LITELLM_BIN = PEERS / "litellm" / "bin" / "litellm"
PORTKEY_JS = PEERS / "portkey" / "node_modules" / "@portkey-ai" / "gateway" / "build" / "start-server.js"
LOW, HIGH = 1, 32
# LiteLLM refuses to start without a master key (and with a weak one); requests carry it.
LITELLM_KEY = "sk-bench-" + "0123456789abcdef" * 4
LITELLM_AUTH = (("Content-Type", "application/json"), ("Authorization", f"Bearer {LITELLM_KEY}"))


def install() -> None:
    PEERS.mkdir(exist_ok=True)
    if not (PEERS / "litellm" / "bin" / "pip").exists():
        subprocess.run([sys.executable, "-m", "venv", str(PEERS / "litellm")], check=True)
    subprocess.run([str(PEERS / "litellm" / "bin" / "pip"), "install", "-q", LITELLM], check=True)
    (PEERS / "portkey").mkdir(exist_ok=True)
    subprocess.run(["npm", "install", "--no-audit", "--no-fund", PORTKEY], cwd=PEERS / "portkey", check=True)


def litellm(procs: Processes, provider: str, cache: bool) -> Server:
    port = free_port()
    config = procs.workdir / f"litellm-{'cache' if cache else 'pass'}.yaml"
    config.write_text(
        "model_list:\n  - model_name: gpt-bench\n    litellm_params:\n      model: openai/gpt-bench\n"
        f"      api_base: {provider}/v1\n      api_key: sk-bench-not-a-real-key\n"
        "litellm_settings:\n  telemetry: false\n"
        + ("  cache: true\n  cache_params:\n    type: local\n" if cache else ""))
    env = {"LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False", "DISABLE_SCHEMA_UPDATE": "True",
           "LITELLM_MASTER_KEY": LITELLM_KEY}
    return procs.start(f"litellm-{port}", [str(LITELLM_BIN), "--config", str(config), "--host", "127.0.0.1",
                                           "--port", str(port), "--num_workers", "1"], port,
                       lambda s: http("GET", s.url + "/health/liveliness", timeout=1)[0] == 200,
                       timeout=120, env=env)


def portkey(procs: Processes) -> Server:
    port = free_port()
    return procs.start(f"portkey-{port}", ["node", str(PORTKEY_JS), f"--port={port}", "--headless"], port,
                       lambda s: http("GET", s.url + "/", timeout=1)[0] < 500, timeout=60,
                       env={"NODE_ENV": "production"})


class Counter:
    def __init__(self, provider: Server):
        self.url, self.counter = provider.url + "/_calls", nginx.CallCounter()

    def __call__(self) -> int:
        return self.counter.count(http("GET", self.url)[2].decode())


def measure(kind: str, url: str, headers: tuple, connections: int, duration: float, calls: Counter,
            key: str = "") -> dict:
    loadgen.run(kind, loadgen.Load(url, connections, 1.0, BODY, headers, key=key))
    time.sleep(0.2)
    before = calls()
    s = loadgen.run(kind, loadgen.Load(url, connections, duration, BODY, headers, key=key))
    time.sleep(0.2)
    return {"rps": round(s.rps, 1), "p50_ms": round(s.p50_ms, 3), "p99_ms": round(s.p99_ms, 3),
            "requests": s.requests, "errors": s.errors, "upstream_calls": calls() - before}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--install", action="store_true", help="install LiteLLM and Portkey under bench/peers/")
    p.add_argument("--duration", type=float, default=4.0)
    p.add_argument("--out", default=str(BENCH / "results" / "peers.json"))
    a = p.parse_args(argv)
    if a.install:
        install()
        return 0
    if not LITELLM_BIN.exists() or not PORTKEY_JS.exists():
        p.error("peers not installed: python bench/peers.py --install")
    kind = loadgen.available("wrk")
    auth = HEADERS
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="idem-peers-") as tmp, Processes(Path(tmp)) as procs:
        provider = procs.nginx()
        calls = Counter(provider)
        base = procs.baseline(provider.url)
        store_url, drop = make_store("sqlite", Path(tmp), "", "")
        idem = procs.idemproxy("idemproxy-sqlite", provider.url, store_url, 1)
        lite, lite_cache, pk = litellm(procs, provider.url, False), litellm(procs, provider.url, True), portkey(procs)
        pk_headers = auth + (("x-portkey-provider", "openai"), ("x-portkey-custom-host", provider.url + "/v1"))
        replay_key = "peers-replay"
        http("POST", idem.url + "/openai" + nginx.CHAT_PATH, BODY.encode(), {**dict(auth), "Idempotency-Key": replay_key})
        http("POST", lite_cache.url + nginx.CHAT_PATH, BODY.encode(), dict(LITELLM_AUTH))  # fills LiteLLM's cache
        cases = [
            ("baseline (plain aiohttp)", "passthrough", base.url + nginx.CHAT_PATH, auth, ""),
            ("idemproxy (sqlite)", "passthrough", idem.url + "/openai" + nginx.CHAT_PATH,
             auth + (("Idem-Policy", "passthrough"),), ""),
            ("idemproxy (sqlite)", "cache hit (replay)", idem.url + "/openai" + nginx.CHAT_PATH, auth, replay_key),
            ("LiteLLM proxy", "passthrough", lite.url + nginx.CHAT_PATH, LITELLM_AUTH, ""),
            ("LiteLLM proxy", "cache hit (local cache)", lite_cache.url + nginx.CHAT_PATH, LITELLM_AUTH, ""),
            ("Portkey gateway", "passthrough", pk.url + nginx.CHAT_PATH, pk_headers, ""),
        ]
        try:
            for name, mode, url, headers, key in cases:
                row = {"proxy": name, "mode": mode}
                for c in (LOW, HIGH):
                    row[f"c{c}"] = m = measure(kind, url, headers, c, a.duration, calls, key)
                    print(f"  {name:26} {mode:24} c{c:<3} {m['rps']:8.0f} req/s  p50 {m['p50_ms']:.3f} ms  "
                          f"upstream calls {m['upstream_calls']} errors {m['errors']}", flush=True)
                rows.append(row)
        finally:
            drop()
    base_row = rows[0]
    lines = ["| proxy | mode | req/s @32 | × baseline @32 | p50 @1 | added p50 @1 | upstream calls |",
             "|---|---|--:|--:|--:|--:|---|"]
    for r in rows:
        hit = "cache" in r["mode"]
        calls_note = ("none" if r["c32"]["upstream_calls"] == 0 else f"{r['c32']['upstream_calls']} (!!)") if hit \
            else "one per request"
        lines.append(f"| {r['proxy']} | {r['mode']} | {r['c32']['rps']:,.0f} | {r['c32']['rps'] / base_row['c32']['rps']:.2f} "
                     f"| {r['c1']['p50_ms']:.3f} ms | {r['c1']['p50_ms'] - base_row['c1']['p50_ms']:+.3f} ms | {calls_note} |")
    lines.append("| Portkey gateway | cache hit | – | – | – | – | not in the open-source build |")
    table = "\n".join(lines)
    print("\n" + table)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as exc:
        print(f"peers: {exc}", file=sys.stderr)
        sys.exit(1)
