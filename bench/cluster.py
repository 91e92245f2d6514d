"""Redis Cluster against one Redis: claim, record and replay rates, p99, WAIT's cost, bytes, spread.

    python bench/cluster.py [--seconds 3] [--rounds 3] [--concurrency 1,32] [--out FILE.md]

Starts its own servers (a private single Redis and a 3+3 cluster from tests/support/redis_cluster.py,
appendonly off on both) and drives the store itself (the journal's calls, as the proxy makes
them, by so many callers at once), in one process: it measures what the store costs, not HTTP.
Each round measures every setup once, in turn, so the machine's drift spreads over all of
them; the figures are each setup's median over the rounds.

- claim: a new key claimed (the claim script; WAIT with redis_wait_replicas)
- record: a new key claimed and its response recorded (claim, then complete)
- replay: a recorded key asked for again (the claim script answering it taken; never WAITs)
- WAITs: how many WAIT commands the masters ran per operation (INFO commandstats)
- busiest: the share of the operation's commands the busiest master ran (INFO stats): 100% for
  one Redis or a deployment in one shard, about a third when its shards spread over three masters
- bytes/entry: the growth of the masters' data sets (INFO used_memory_dataset: keys and values,
  not the replication backlog or client buffers) per recorded entry (a 450-byte body, in a run:
  entry hash, run journal, expiry index), over 2,000 entries

The cluster is measured with a deployment in one shard (``shards=1``: every earlier version's
layout) and in the default sixteen (proxy/store/redis/shards.py).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "support"))

import redis  # noqa: E402

from idemproxy.proxy.store.model import Claim, Recorded, Scope  # noqa: E402
from idemproxy.proxy.store.redis import redis_store  # noqa: E402
from redis_cluster import STEADY_MS, RedisCluster  # noqa: E402
from services import PrivateRedis  # noqa: E402

BODY = b'{"id":"chatcmpl-bench","object":"chat.completion","choices":[{"index":0,"message":' + b"x" * 370 + b"}]}"
REPLY = Recorded(200, [("content-type", "application/json")], BODY)
ENTRIES_FOR_BYTES = 2000
RUNS = 64


def claim_of(key: str, run: str = "bench-run") -> Claim:
    return Claim(Scope("tenant", run, "openai", key), "fp", uuid.uuid4().hex, 60.0, 3600.0, "POST",
                 "/v1/chat/completions", None, "retry", "bench")


def run_of(i: int) -> str:
    """Calls spread over RUNS runs, as many agents' are."""
    return f"bench-run-{i % RUNS}"


async def drive(op, seconds: float, concurrency: int) -> tuple[float, float, float]:
    """(operations/s, p50 ms, p99 ms) of ``op(i)`` run by ``concurrency`` tasks for ``seconds``."""
    latencies: list[float] = []
    counter = iter(range(10 ** 9))
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            await op(next(counter))
            latencies.append(time.perf_counter() - started)
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    latencies.sort()
    return (len(latencies) / elapsed, latencies[len(latencies) // 2] * 1000,
            latencies[int(len(latencies) * 0.99)] * 1000)


def counts(ports: list[int]) -> list[tuple[int, int]]:
    """(WAIT commands run, commands run) by each Redis of ``ports``."""
    found = []
    for port in ports:
        raw = redis.Redis(port=port)
        try:
            found.append((raw.info("commandstats").get("cmdstat_wait", {}).get("calls", 0),
                          raw.info("stats")["total_commands_processed"]))
        finally:
            raw.close()
    return found


async def measure(url: str, ports: list[int], wait: int, seconds: float,
                  concurrency: int) -> dict[str, tuple[float, float, float, float, float]]:
    """{operation: (operations/s, p50 ms, p99 ms, WAITs per operation, the busiest master's share)}"""
    store = redis_store(url, timeout=5.0, wait_replicas=wait)
    await store.open()
    tag = uuid.uuid4().hex[:8]
    try:
        journal = store.journal

        async def claim(i: int) -> None:
            assert (await journal.claim(claim_of(f"c-{tag}-{i}", run_of(i)))).won

        async def record(i: int) -> None:
            c = claim_of(f"r-{tag}-{i}", run_of(i))
            assert (await journal.claim(c)).won
            assert await journal.complete(c.scope.kid, c.owner, REPLY)

        recorded = []
        for i in range(200):  # the keys replays ask for
            c = claim_of(f"p-{tag}-{i}", run_of(i))
            await journal.claim(c)
            await journal.complete(c.scope.kid, c.owner, REPLY)
            recorded.append(c)

        async def replay(i: int) -> None:
            c = recorded[i % len(recorded)]
            result = await journal.claim(claim_of(c.scope.key, c.scope.run))
            assert not result.won and result.entry.response is not None

        figures = {}
        for name, op in (("claim", claim), ("record", record), ("replay", replay)):
            before = counts(ports)
            rate, p50, p99 = await drive(op, seconds, concurrency)
            after = counts(ports)
            ran = [a[1] - b[1] for a, b in zip(after, before)]
            waited = sum(a[0] - b[0] for a, b in zip(after, before))
            figures[name] = (rate, p50, p99, waited / (rate * seconds), max(ran) / sum(ran))
        return figures
    finally:
        await store.aclose()


async def bytes_per_entry(url: str, ports: list[int]) -> float:
    raws = [redis.Redis(port=port) for port in ports]
    store = redis_store(url, timeout=5.0)
    await store.open()

    def dataset() -> int:
        return sum(raw.info("memory")["used_memory_dataset"] for raw in raws)
    try:
        for raw in raws:
            raw.execute_command("MEMORY", "PURGE")
        before = dataset()
        run = f"bytes-{uuid.uuid4().hex[:6]}"
        for start in range(0, ENTRIES_FOR_BYTES, 100):
            claims = [claim_of(f"b-{i}", run) for i in range(start, start + 100)]
            await asyncio.gather(*(store.journal.claim(c) for c in claims))
            await asyncio.gather(*(store.journal.complete(c.scope.kid, c.owner, REPLY) for c in claims))
        return (dataset() - before) / ENTRIES_FOR_BYTES
    finally:
        await store.aclose()
        for raw in raws:
            raw.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", default="1,32", help="callers at once, a comma-separated list")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    single = PrivateRedis().start()
    cluster = RedisCluster(node_timeout_ms=STEADY_MS).start()
    try:
        masters = cluster.ports[:3]  # the first three start as masters
        one_shard, shards = f"{cluster.url}/?prefix=bench1:&shards=1", f"{cluster.url}/?prefix=bench16:"
        setups = {"one Redis": (single.url + "?prefix=bench:", [single.port], 0),
                  "cluster, one shard": (one_shard, masters, 0),
                  "cluster, 16 shards": (shards, masters, 0),
                  "cluster, one shard, redis_wait_replicas = 1": (one_shard, masters, 1),
                  "cluster, 16 shards, redis_wait_replicas = 1": (shards, masters, 1)}
        counts = [int(n) for n in args.concurrency.split(",")]
        runs: dict[tuple[int, str], list[dict]] = {(n, name): [] for n in counts for name in setups}
        for _ in range(args.rounds):
            for n in counts:
                for name, (url, ports, wait) in setups.items():
                    runs[n, name].append(asyncio.run(measure(url, ports, wait, args.seconds, n)))
        sizes = {"one Redis": asyncio.run(bytes_per_entry(single.url + "?prefix=size:", [single.port])),
                 "cluster, one shard": asyncio.run(bytes_per_entry(f"{cluster.url}/?prefix=size1:&shards=1", masters)),
                 "cluster, 16 shards": asyncio.run(bytes_per_entry(f"{cluster.url}/?prefix=size16:", masters))}
    finally:
        cluster.destroy()
        single.destroy()

    lines = [f"{args.seconds:g} s a measurement, median of {args.rounds} rounds; operations/s, p50 and p99 "
             "in ms, WAITs the masters ran per operation, the busiest master's share of the commands", "",
             "| callers | setup | claim /s | p50 | p99 | WAITs | busiest | record /s | p50 | p99 | WAITs | busiest "
             "| replay /s | p50 | p99 | WAITs | busiest |", "|---" * 17 + "|"]
    for (n, name), rounds in runs.items():
        cells = [str(n), name]
        for op in ("claim", "record", "replay"):
            rate, p50, p99, wait_calls, busiest = (statistics.median(r[op][k] for r in rounds) for k in range(5))
            cells += [f"{rate:,.0f}", f"{p50:.2f}", f"{p99:.2f}", f"{wait_calls:.2f}", f"{busiest:.0%}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| setup | Redis bytes per recorded entry |", "|---|---|"]
    lines += [f"| {name} | {size:,.0f} |" for name, size in sizes.items()]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
