"""A journal of millions: do records and replays slow down as the store
fills, what does an entry cost in bytes, and what does purging a day cost while serving?

    python bench/million.py [--entries 1000000] [--stores sqlite,postgres,redis]
                            [--duration 3] [--warmup 1] [--out bench/results/million.json]

For each store, in front of nginx (bench/nginx.py), one ``idemproxy serve`` process:

1. measures record and replay (one key) on the empty store, at 1 and 32 connections;
2. seeds N entries through the store's own bulk path (bench/seed.py), cloned from two the
   proxy recorded, and replays a few seeded keys through the proxy (the seeded body must
   come back, with no upstream call): the seeded journal is one the proxy reads as its own;
3. reports the journal's bytes per entry (SQLite: pages in use; PostgreSQL:
   ``pg_total_relation_size('journal')``; Redis, on a private redis-server:
   ``used_memory``), each as the growth over the empty store divided by N;
4. measures record, replay (one key) and replay-seeded (a different seeded entry per
   request) on the full store;
5. SQLite and PostgreSQL: purges the oldest day (``POST /admin/purge``, so the proxy's own
   purge runs, as its timer would) while the record load runs in one-second slices, and
   reports the purge's time, the entries purged, and req/s and p99 of the slices during the
   purge against three just before it. (Redis expires entries by itself: nothing to purge.)

Prints a markdown table and writes every figure to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import loadgen  # noqa: E402
import processes  # noqa: E402
import run  # noqa: E402
import seed  # noqa: E402
from processes import REPO, BenchError, Processes, Server, http, make_store  # noqa: E402

ADMIN_TOKEN = "bench-million-admin"
# The proxy's own purge timer stays out of the way: the purge is started when measured.
PROXY_ENV = {"IDEMPROXY_STORE_PURGE_INTERVAL": "86400", "IDEMPROXY_ADMIN_TOKEN": ADMIN_TOKEN}
SEEDED = run.Scenario("replay-seeded", "/openai{chat}", key="seeded", upstream=False)
EMPTY_SCENARIOS = ("record", "replay")
FULL_SCENARIOS = ("record", "replay", "replay-seeded")
CALM_SLICES = 3
PURGE_TIMEOUT_S = 900.0


class MillionBench(run.Bench):
    """run.Bench, plus a scenario whose fresh keys are seeded ones (wrk's prefix seed-{p})."""
    prefixes: list[str]

    def load(self, server: Server, scenario: run.Scenario, connections: int, duration: float) -> loadgen.Load:
        load = super().load(server, scenario, connections, duration)
        if scenario.key != "seeded":
            return load
        if not self.prefixes:
            raise BenchError("every seeded key prefix is used up: seed more prefixes (seed.SEED_PREFIXES)")
        return loadgen.Load(load.url, load.connections, load.duration, load.body, load.headers,
                            key_prefix=f"seed-{self.prefixes.pop(0)}")


def scenario(name: str) -> run.Scenario:
    return SEEDED if name == SEEDED.name else run.SCENARIOS[name]


def store_url(bench: MillionBench, store: str) -> tuple[str, Callable[[], None]]:
    a = bench.args
    if store == "redis" and a.redis_url == "private":  # used_memory is then ours alone
        server = bench.procs.redis(*a.redis_config)
        return f"redis://127.0.0.1:{server.port}/0?prefix=idem:", lambda: bench.procs.stop(server)
    return make_store(store, bench.procs.workdir, a.postgres_url, a.redis_url)


def record_run_template(bench: MillionBench, server: Server) -> str:
    """One entry in a run, recorded by the proxy: the template of seeded steps."""
    key = f"bench-{bench.tag}-run-template"
    status, headers, _ = http("POST", server.url + bench.path(run.SCENARIOS["run-record"]),
                              run.BODY.encode(), {**dict(run.HEADERS), "Idempotency-Key": key})
    if status != 200 or headers.get("Idempotent-Replayed") != "false":
        raise BenchError(f"run template: {status} {headers}")
    return key


def verify_seeded(bench: MillionBench, server: Server, probes: list[seed.Seeded]) -> int:
    """Seeded entries replay through the proxy: their own body, no upstream call."""
    before = bench.upstream_calls()
    chat = bench.path(run.SCENARIOS["record"])
    for probe in probes:
        path = (f"/runs/{probe.run}/epochs/0" if probe.run else "") + chat
        status, headers, body = http("POST", server.url + path, run.BODY.encode(),
                                     {**dict(run.HEADERS), "Idempotency-Key": probe.key})
        if (status, headers.get("Idempotent-Replayed"), body) != (200, "true", probe.body):
            raise BenchError(f"seeded key {probe.key} (run {probe.run}) did not replay: "
                             f"{status} {headers} {body[:200]!r}")
    if bench.upstream_calls() != before:
        raise BenchError("replaying seeded keys reached the provider")
    return len(probes)


def record_slice(bench: MillionBench, server: Server) -> dict:
    """One second of the record scenario at 32 connections."""
    began = time.monotonic()
    s = loadgen.run(bench.kind, bench.load(server, run.SCENARIOS["record"], run.HIGH, 1.0))
    return {"at_s": round(began, 3), "rps": round(s.rps, 1), "p50_ms": round(s.p50_ms, 3),
            "p99_ms": round(s.p99_ms, 3), "max_ms": round(s.max_ms, 3), "errors": s.errors}


def purge_while_serving(bench: MillionBench, server: Server) -> dict:
    """The proxy purges the expired day while the record load runs, in one-second slices."""
    calm = [record_slice(bench, server) for _ in range(CALM_SLICES)]
    outcome: dict = {}

    def purge() -> None:
        began = time.monotonic()
        outcome["answer"] = http("POST", server.url + "/admin/purge", b"",
                                 {"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=PURGE_TIMEOUT_S)
        outcome["seconds"] = time.monotonic() - began

    worker = threading.Thread(target=purge, name="purge")
    worker.start()
    during = []
    while worker.is_alive():
        during.append(record_slice(bench, server))
    worker.join()
    status, _, body = outcome["answer"]
    if status != 200:
        raise BenchError(f"/admin/purge answered {status}: {body[:300]!r}")
    return {"purged": json.loads(body)["purged"], "seconds": round(outcome["seconds"], 3),
            "calm": calm, "during": during, "calm_summary": _slices(calm), "during_summary": _slices(during)}


def _slices(slices: list[dict]) -> dict:
    if not slices:
        return {}
    p99s = sorted(s["p99_ms"] for s in slices)
    return {"rps": round(sum(s["rps"] for s in slices) / len(slices), 1),
            "p99_ms_median": p99s[len(p99s) // 2], "p99_ms_max": p99s[-1], "max_ms": max(s["max_ms"] for s in slices),
            "errors": sum(sum(s["errors"].values()) for s in slices)}


def measure_all(bench: MillionBench, store: str, server: Server, entries: int, names: tuple[str, ...],
                results: list[dict]) -> None:
    for name in names:
        for connections in (run.LOW, run.HIGH):
            m = bench.measure(store, 1, server, scenario(name), connections)
            m["entries"] = entries
            results.append(m)


def run_store(bench: MillionBench, store: str, results: list[dict], stores: dict) -> None:
    n = bench.args.entries
    bench.prefixes = list(seed.SEED_PREFIXES)
    template_of, seed_into, bytes_of = seed.SEEDERS[store]
    url, drop = store_url(bench, store)
    server = None
    try:
        server = bench.procs.idemproxy(f"idemproxy-{store}", bench.provider.url, url, 1, env=PROXY_ENV)
        run.probe(bench, server)
        run_key = record_run_template(bench, server)
        measure_all(bench, store, server, 0, EMPTY_SCENARIOS, results)
        empty = bytes_of(url)
        template = template_of(url, bench.replay_key(server), run_key)
        layout = seed.Layout(n, time.time(), template.plain["expires_at"] - template.plain["created_at"],
                             expired=store != "redis")
        began = time.monotonic()
        print(f"  {store}: seeding {n:,} entries ...", flush=True)
        seed_into(url, template, layout)
        seeded_s = time.monotonic() - began
        full = bytes_of(url)
        info = {"entries": n, "seed_seconds": round(seeded_s, 1), "bytes_empty": empty, "bytes_full": full,
                "bytes_per_entry": round((full - empty) / n, 1), "entries_per_day": layout.per_day,
                "retention_days": round(layout.retention / seed.DAY, 2),
                "verified_replays": verify_seeded(bench, server, seed.probes(template, layout))}
        print(f"  {store}: seeded in {seeded_s:.0f}s, {info['bytes_per_entry']:.0f} bytes/entry, "
              f"{info['verified_replays']} seeded keys replayed through the proxy", flush=True)
        measure_all(bench, store, server, n, FULL_SCENARIOS, results)
        if layout.expired:
            info["purge"] = p = purge_while_serving(bench, server)
            print(f"  {store}: purged {p['purged']:,} entries in {p['seconds']:.1f}s; record "
                  f"{p['calm_summary']['rps']:.0f} -> {p['during_summary'].get('rps', 0):.0f} req/s, "
                  f"p99 {p['calm_summary']['p99_ms_max']:.1f} -> {p['during_summary'].get('p99_ms_max', 0):.1f} ms",
                  flush=True)
        stores[store] = info
    finally:
        if server is not None:
            bench.procs.stop(server)
        drop()


def markdown(results: list[dict], stores: dict, meta: dict) -> str:
    lines = [f"idemproxy million-entry benchmark, {meta['started']}, git {meta['git']}, {meta['cpus']} CPUs, "
             f"{meta['duration_s']:g}s per measurement; load average {_load(meta['loadavg_start'])} at start, "
             f"{_load(meta.get('loadavg_end'))} at end", "",
             "| store | scenario | entries | req/s @32 | CPU µs/req @32 | p50 @32 | p99 @32 | p50 @1 | p99 @1 "
             "| checks |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|---|"]
    rows: dict[tuple, dict] = {}
    for m in results:
        rows.setdefault((m["store"], m["scenario"], m["entries"]), {})[m["connections"]] = m
    for (store, name, entries), by in rows.items():
        hi, lo = by.get(run.HIGH, {}), by.get(run.LOW, {})
        bad = [f"c{m['connections']}: errors {m['errors']}" for m in by.values() if m["errors"]] + \
              [f"c{m['connections']}: {m['upstream_calls']} upstream calls" for m in by.values() if not m["calls_ok"]]
        cpu = (hi.get("cpu_us_per_request") or {}).get("server")
        lines.append(f"| {store} | {name} | {entries:,} | {hi.get('rps', 0):,.0f} | {_num(cpu, '.0f')} "
                     f"| {hi.get('p50_ms', 0):.2f} | {hi.get('p99_ms', 0):.2f} | {lo.get('p50_ms', 0):.3f} "
                     f"| {lo.get('p99_ms', 0):.3f} | {'!! ' + '; '.join(bad) if bad else 'ok'} |")
    lines += ["", "| store | entries | seeded in | bytes/entry | entries/day | purge: entries | purge: s "
              "| record req/s calm → purging | record p99 ms calm → purging (median slice; worst) |",
              "|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for store, info in stores.items():
        p = info.get("purge")
        purge = (f"{p['purged']:,} | {p['seconds']:.1f} | {p['calm_summary']['rps']:,.0f} → "
                 f"{p['during_summary'].get('rps', 0):,.0f} | {p['calm_summary']['p99_ms_median']:.0f} → "
                 f"{p['during_summary'].get('p99_ms_median', 0):.0f}; {p['calm_summary']['p99_ms_max']:.0f} → "
                 f"{p['during_summary'].get('p99_ms_max', 0):.0f}") if p else "– | – | – | –"
        lines.append(f"| {store} | {info['entries']:,} | {info['seed_seconds']:.0f} s | {info['bytes_per_entry']:,.0f} "
                     f"| {info['entries_per_day']:,} | {purge} |")
    return "\n".join(lines)


def _num(value, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def _load(avg) -> str:
    return "–" if not avg else "/".join(f"{x:.1f}" for x in avg)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--entries", type=int, default=1_000_000, help="journal entries to seed (default 1,000,000)")
    p.add_argument("--stores", type=run._csv, default=["sqlite", "postgres", "redis"])
    p.add_argument("--duration", type=float, default=3.0, help="seconds per measurement (default 3)")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--loadgen", choices=("auto", "wrk", "python"), default="auto")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "million.json"))
    p.add_argument("--postgres-url", default=os.environ.get(
        "IDEMPROXY_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test"))
    p.add_argument("--redis-url", default="private",
                   help="'private' (default: a redis-server of our own, so used_memory is ours alone) or a URL")
    p.add_argument("--redis-config", action="append", default=[], metavar='"NAME VALUE"',
                   help="an option for the private redis-server, e.g. 'hash-max-listpack-value 1024'")
    p.add_argument("--profile", metavar="DIR",
                   help="sample idemproxy with py-spy at 32 connections (as bench/run.py); the full store's "
                        "profiles overwrite the empty one's")
    args = p.parse_args(argv)
    args.provider, args.scenarios = "nginx", [*FULL_SCENARIOS]
    if args.profile:
        args.py_spy = processes.py_spy()
        if args.py_spy is None:
            p.error("--profile needs py-spy (pip install py-spy)")
    if args.entries < 1000:
        p.error("--entries: at least 1000")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    processes.stop_on_signals()
    kind = loadgen.available(args.loadgen)
    meta = {**processes.run_facts(kind, args.duration), "entries": args.entries, "machine": platform.node(),
            "redis_config": args.redis_config}
    results: list[dict] = []
    stores: dict[str, dict] = {}
    errors: dict[str, str] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="idem-million-") as tmp, Processes(Path(tmp)) as procs:
            bench = MillionBench(args, kind, procs, procs.nginx())
            for store in args.stores:
                try:
                    run_store(bench, store, results, stores)
                except BenchError as exc:
                    errors[store] = str(exc)
                    print(f"  {store}: FAILED: {exc}", file=sys.stderr, flush=True)
    finally:
        meta["loadavg_end"] = os.getloadavg()
        if results:
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"meta": meta, "errors": errors, "stores": stores,
                                       "measurements": results}, indent=2) + "\n")
            print()
            print(markdown(results, stores, meta))
            print(f"\nwritten: {out}")
    return 1 if errors else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
