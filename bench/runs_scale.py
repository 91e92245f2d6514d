"""100,000 supervised runs (docs/sizing.md, "Supervised runs"): what a supervisor tick, the
heartbeats and a restart cost with that many runs live.

For each store, on a fresh one (a SQLite file, a PostgreSQL schema, a Redis prefix), through
the store's own run registry (the code the proxy and the supervisor run):

1. tick: runs are seeded live (seen now, ``timeout_s`` 30) up to each of ``--live``; at each
   size, a supervisor tick's query (``runs.silent``) is timed with no run due and with
   ``--due`` runs silent past their timeout (then buried, so the next size starts clean);
   then what a run takes in the store (bytes per run: table and indexes, file, or memory);
2. heartbeats: beats for ``--beats`` of the live runs written as the proxy's flush writes
   them (``runs.touch``: one call a second for every run seen in it), and as the runs API
   writes them: one ``POST /runs/{id}/heartbeat``'s store call per beat (``runs.heartbeat``),
   ``--api-at-once`` agents beating together;
3. restart: with every live run beating (one ``touch`` a second for a fifth of them: each
   every 5 s), ``--restart`` runs fall silent together and ``--replicas`` supervisors
   (each with its own store connection, ticking every ``--interval`` s) restart them through
   an HTTP hook that counts its calls. Reported: from the moment they were due to each
   hook call (p50, p99, max), how the restarts were shared, and double restarts (a run whose
   hook was called twice, or whose epoch is past 1): there must be none.

    python bench/runs_scale.py                          # all three stores; several minutes
    python bench/runs_scale.py --stores postgres --live 1000,100000
    python bench/runs_scale.py --stores redis-cluster         # a private 3-master cluster

Times are wall-clock medians of ``--reps`` on a shared machine: read them as orders of
magnitude and against each other within one run. Writes a JSON of every figure (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

from urllib.parse import parse_qsl, urlsplit, urlunsplit

import asyncpg
import redis.asyncio as redis_asyncio
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
from processes import make_store  # noqa: E402
from redis_cluster import STEADY_MS, RedisCluster  # noqa: E402

from idemproxy.proxy.config import load_settings  # noqa: E402
from idemproxy.proxy.runs import RunsService  # noqa: E402
from idemproxy.proxy.store import open_store  # noqa: E402
from idemproxy.proxy.store.model import Run, RunState  # noqa: E402
from idemproxy.proxy.store.redis.values import run_ref  # noqa: E402
from idemproxy.supervisor.hooks import Hooks  # noqa: E402
from idemproxy.supervisor.loop import Supervisor  # noqa: E402

NS = "bench"
TIMEOUT_S = 30.0
SEED_AT_ONCE = 64  # upserts in flight while seeding
FLUSH = 10_000  # beats in one touch: what a few proxies' flushes of a second hold at 100,000 runs


def settings_for(url: str, hook_url: str = "http://127.0.0.1:9/", interval: float = 0.5):
    return load_settings(None, env={}, overrides={
        "store.url": url, "supervisor.interval_s": interval,
        "supervisor.max_restarts_per_minute": 1_000_000, "hooks.agent.url": hook_url,
        "hooks.agent.retries": 0})


async def seed(store, ids: list[str], last_seen: float) -> None:
    """Runs ``ids``, seen at ``last_seen``, with the hook ``agent``."""
    async def one(run_id: str) -> None:
        await store.runs.upsert(Run(NS, run_id, last_seen=last_seen, started_at=last_seen - TIMEOUT_S,
                                    created_at=last_seen, timeout_s=TIMEOUT_S, grace_s=0, hook="agent"))
    for i in range(0, len(ids), SEED_AT_ONCE):
        await asyncio.gather(*(one(run_id) for run_id in ids[i:i + SEED_AT_ONCE]))


async def touch_all(store, ids, at: float) -> None:
    """Beats for every run of ``ids``, in flushes of FLUSH (as proxies would send them)."""
    for i in range(0, len(ids), FLUSH):
        await store.runs.touch({(NS, run_id, None): at for run_id in ids[i:i + FLUSH]})


async def timed(op, reps: int) -> float:
    """Median seconds of ``op()`` over ``reps``, after one warm-up."""
    await op()
    took = []
    for _ in range(reps):
        started = time.perf_counter()
        await op()
        took.append(time.perf_counter() - started)
    return statistics.median(took)


async def measure_ticks(store, sizes: list[int], due: int, reps: int) -> list[dict]:
    rows, live = [], 0
    for size in sizes:
        await seed(store, [f"live-{i}" for i in range(live, size)], time.time())
        now = time.time()  # seeding takes a while: every live run is seen now, none is due
        await touch_all(store, [f"live-{i}" for i in range(size)], now)
        live = size
        assert await store.runs.silent(time.time()) == []
        idle = await timed(lambda: store.runs.silent(time.time()), reps)
        silent_ids = [f"silent-{size}-{i}" for i in range(due)]
        await seed(store, silent_ids, now - 10 * TIMEOUT_S)
        found = await store.runs.silent(time.time())
        busy = await timed(lambda: store.runs.silent(time.time()), reps)
        for run_id in silent_ids:  # buried, as the supervisor would: the next size starts clean
            await store.runs.end(NS, run_id, RunState.DEAD, time.time())
        rows.append({"live": size, "due": due, "found": len(found), "tick_ms_none_due": idle * 1000,
                     "tick_ms_due": busy * 1000})
        print(f"    {size:>7,} live: tick {idle * 1000:8.2f} ms with none due, "
              f"{busy * 1000:8.2f} ms with {due:,} due ({len(found):,} found)", flush=True)
    return rows


async def bytes_per_run(url: str, live: int) -> float:
    """What a live run takes in the store: the runs table with its indexes (PostgreSQL), the
    file (SQLite, which holds nothing else here), or memory (Redis: the run's hash and name
    set, sampled, plus its share of the indexes), divided by the runs there."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    if parts.scheme == "sqlite":  # the pages in use, the write-ahead log's included
        with contextlib.closing(sqlite3.connect(parts.path)) as db:
            pages = db.execute("PRAGMA page_count").fetchone()[0] - db.execute("PRAGMA freelist_count").fetchone()[0]
            return pages * db.execute("PRAGMA page_size").fetchone()[0] / live
    if parts.scheme.startswith("postgres"):
        conn = await asyncpg.connect(urlunsplit(parts._replace(query="")))
        try:
            table = f'"{query["schema"]}".runs'
            await conn.execute(f"VACUUM ANALYZE {table}")
            size, n = await conn.fetchrow(f"SELECT pg_total_relation_size('{table}'), count(*) FROM {table}")
        finally:
            await conn.close()
        return size / n
    client = redis_asyncio.Redis.from_url(urlunsplit(parts._replace(query="")))
    prefix = query["prefix"]
    try:
        sample = [run_ref(NS, f"live-{i}") for i in range(0, live, max(1, live // 1000))]
        own = [await client.memory_usage(f"{prefix}run:{rk}", samples=0) for rk in sample]
        named = [await client.memory_usage(f"{prefix}runs-named:{rk.split(':', 2)[2]}", samples=0) for rk in sample]
        indexes = [await client.memory_usage(f"{prefix}{name}", samples=0) or 0
                   for name in ("runs", "runs:running", "runs-deadline", "runs-idle")]
        n = await client.zcard(f"{prefix}runs")
    finally:
        await client.aclose()
    return statistics.mean(own) + statistics.mean(named) + sum(indexes) / n


async def measure_beats(store, live: int, beats: int, api_at_once: list[int]) -> dict:
    ids = [f"live-{i % live}" for i in range(beats)]
    started = time.perf_counter()
    await store.runs.touch({(NS, run_id, None): time.time() for run_id in ids})
    batched = beats / (time.perf_counter() - started)
    out = {"beats": beats, "batched_per_s": batched, "api_per_s": {}}
    for at_once in api_at_once:  # POST /runs/{id}/heartbeat's store call, `at_once` agents together
        single = ids[:min(beats, 40 * at_once)]
        started = time.perf_counter()
        for i in range(0, len(single), at_once):
            await asyncio.gather(*(store.runs.heartbeat(NS, run_id, time.time())
                                   for run_id in single[i:i + at_once]))
        out["api_per_s"][at_once] = len(single) / (time.perf_counter() - started)
    api = ", ".join(f"{rate:,.0f}/s {n} at once" for n, rate in out["api_per_s"].items())
    print(f"    heartbeats: {batched:,.0f}/s in one flush of {beats:,}; runs API: {api}", flush=True)
    return out


class HookCounter:
    """An HTTP hook that notes when each (run, epoch) was called."""

    def __init__(self):
        self.calls: dict[str, list[tuple[float, int]]] = collections.defaultdict(list)
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def called(self, request: web.Request) -> web.Response:
        facts = await request.json()
        self.calls[facts["run_id"]].append((time.time(), int(facts["epoch"])))
        return web.Response(text="ok")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/hook", self.called)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/hook"


async def measure_restart(url: str, store, live: int, n: int, replicas: int, interval: float) -> dict:
    hook = HookCounter()
    await hook.start()
    settings = settings_for(url, hook.url, interval)
    stores = [await open_store(settings) for _ in range(replicas)]
    supervisors = [Supervisor(RunsService(s, settings, Hooks(settings, s)), settings) for s in stores]
    ids = [f"restart-{i}" for i in range(n)]
    await touch_all(store, [f"live-{i}" for i in range(live)], time.time())  # all alive
    due_at = time.time()
    await seed(store, ids, due_at - TIMEOUT_S)  # due from now on
    cpu = time.process_time()
    done = asyncio.Event()
    restarted: list[collections.Counter] = [collections.Counter() for _ in supervisors]

    async def beat_all() -> None:  # every live run every 5 s: a fifth of them each second
        second = 0
        while not done.is_set():
            await touch_all(store, [f"live-{i}" for i in range(second % 5, live, 5)], time.time())
            second += 1
            await asyncio.sleep(1.0)

    async def supervise(i: int) -> None:
        while not done.is_set():
            for _, action in await supervisors[i].tick():
                restarted[i][action] += 1
            if all(run_id in hook.calls for run_id in ids):
                done.set()
            await asyncio.sleep(interval)

    beating = asyncio.create_task(beat_all())
    try:
        await asyncio.wait_for(asyncio.gather(*(supervise(i) for i in range(replicas))), timeout=600)
        for s in supervisors:
            await s.runs.launcher.wait_idle()
        cpu = time.process_time() - cpu
        await asyncio.sleep(0.5)
    finally:
        done.set()
        await beating
        for s, opened in zip(supervisors, stores):
            await s.runs.launcher.aclose()
            await opened.aclose()
        await hook.runner.cleanup()
    latencies = sorted(calls[0][0] - due_at for calls in hook.calls.values())
    runs = [r for run_id in ids for r in await store.runs.find(NS, run_id)]
    doubles = sum(len(hook.calls[i]) > 1 for i in ids) + sum(r.epoch > 1 for r in runs)
    live_restarted = sum(not run_id.startswith("restart-") for run_id in hook.calls)
    result = {"live": live, "restarted": n, "replicas": replicas, "interval_s": interval,
              "hooks_called": len(hook.calls), "double_restarts": doubles, "live_restarted": live_restarted,
              "bench_cpu_ms_per_restart": cpu * 1000 / n,
              "per_replica": [c["restart"] for c in restarted],
              "p50_s": latencies[len(latencies) // 2], "p99_s": latencies[int(len(latencies) * 0.99)],
              "max_s": latencies[-1]}
    print(f"    restart: {n:,} silent among {live:,} live, {replicas} supervisors: due -> hook p50 "
          f"{result['p50_s']:.2f} s, p99 {result['p99_s']:.2f} s, max {result['max_s']:.2f} s; per replica "
          f"{result['per_replica']}; double restarts {doubles}, live runs restarted {live_restarted}; "
          f"{result['bench_cpu_ms_per_restart']:.2f} ms of this process's CPU per restart", flush=True)
    return result


async def run_store(url: str, a: argparse.Namespace) -> dict:
    store = await open_store(settings_for(url))
    try:
        sizes = [int(s) for s in a.live.split(",")]
        out = {"ticks": await measure_ticks(store, sizes, a.due, a.reps)}
        if "+cluster" not in url:  # a cluster keeps the same keys as one Redis
            out["bytes_per_run"] = await bytes_per_run(url, sizes[-1])
            print(f"    {out['bytes_per_run']:,.0f} bytes per run", flush=True)
        out["heartbeats"] = await measure_beats(store, sizes[-1], min(a.beats, sizes[-1]),
                                                [int(n) for n in a.api_at_once.split(",")])
        if a.restart:
            out["restart"] = await measure_restart(url, store, sizes[-1], a.restart, a.replicas, a.interval)
        return out
    finally:
        await store.aclose()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stores", default="sqlite,postgres,redis", help="and redis-cluster")
    p.add_argument("--live", default="1000,10000,100000", help="live runs at each tick measurement")
    p.add_argument("--due", type=int, default=1000, help="runs silent at once, for the busy tick")
    p.add_argument("--beats", type=int, default=20000, help="beats in one flush (100,000 runs every 5 s)")
    p.add_argument("--api-at-once", default="32,512", help="runs API heartbeats sent together")
    p.add_argument("--restart", type=int, default=1000, help="runs that fall silent together")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--interval", type=float, default=0.5, help="each supervisor's [supervisor] interval_s")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--pool-size", type=int, default=8, help="PostgreSQL connections of each store opened")
    p.add_argument("--postgres-url", default=os.environ.get("IDEMPROXY_TEST_POSTGRES",
                                                             "postgresql://postgres@127.0.0.1:5432/test"))
    p.add_argument("--redis-url", default=os.environ.get("IDEMPROXY_TEST_REDIS", "redis://127.0.0.1:6379/0"))
    p.add_argument("--out", default="bench/results/runs-scale.json")
    a = p.parse_args()
    results = {"args": vars(a), "stores": {}}
    with tempfile.TemporaryDirectory(prefix="runs-scale-") as tmp:
        for kind in a.stores.split(","):
            if kind == "redis-cluster":  # a private one: 3 masters, 3 replicas (tests/support/redis_cluster.py)
                cluster = RedisCluster(node_timeout_ms=STEADY_MS).start()
                url, drop = f"{cluster.url}/?prefix=bench:", cluster.destroy
            else:
                url, drop = make_store(kind, Path(tmp), a.postgres_url, a.redis_url)
            if kind == "postgres":  # four stores open at once (the bench's, three supervisors')
                url += f"&pool_size={a.pool_size}"
            print(f"  {kind}:", flush=True)
            try:
                results["stores"][kind] = asyncio.run(run_store(url, a))
            finally:
                drop()
    Path(a.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
