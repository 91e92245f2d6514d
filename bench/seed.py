"""Fill a store with a journal of N entries, fast, exactly as the proxy writes them.

The proxy records two entries first (one plain, one in a run); :func:`template` reads them
back from the store, and :func:`entries` clones them N times, changing only what differs
between two real entries: kid, tenant, run, key, fingerprint, times and the completion's id.
So every column holds what the proxy itself would have written, and the proxy replays a
seeded entry as one of its own (bench/million.py checks that, through the proxy).

Each store is written through its own bulk path: SQLite ``executemany`` in one transaction,
PostgreSQL ``COPY``, Redis pipelines. The times cover one retention and one day more, in
creation order (as a journal grows), so the oldest day's entries are expired and due for
a purge (SQLite and PostgreSQL; Redis expires its keys by itself, so there every seeded
entry is live):

- half the entries (even i, live for an hour yet) belong to the benchmark's own credential, under
  keys ``seed-{p}1-{n}``: wrk's fresh keys with the prefix ``seed-{p}`` (bench/wrk.lua)
  replay them, a different entry per request;
- the others are steps of runs (50 a run) and plain calls of 97 other tenants, and of the
  benchmark's credential (one in ten), under keys of their own.
"""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
from dataclasses import dataclass
from typing import Iterator
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from idemproxy.proxy.store import sqlite_path
from idemproxy.proxy.store.model import Scope

SEED_PREFIXES = "abcd"  # one per load run that replays seeded keys (warm-up and measure, 1 and 32)
OTHER_TENANTS = 97
STEPS_PER_RUN = 50
DAY = 86400.0
REPLAYABLE_FOR = 3600.0  # seeded keys to replay stay live at least this long after seeding
COMPLETION_ID = "chatcmpl-bench0000000000000000000000"  # bench/nginx.py's; replaced per entry


@dataclass
class Template:
    """Two entries the proxy wrote: ``plain`` (no run) and ``in_run``, as {column: value}."""
    plain: dict
    in_run: dict


@dataclass(frozen=True)
class Layout:
    """Which entry goes where: N entries over one retention plus a day, oldest first."""
    n: int
    now: float
    retention: float
    expired: bool = True  # False (Redis): the span starts one retention ago, nothing is expired

    @property
    def span(self) -> float:
        return self.retention + (DAY if self.expired else 0.0) - 60.0

    def created(self, i: int) -> float:
        return self.now - self.span - 60.0 + i * self.span / self.n

    def is_expired(self, i: int, within: float = 0.0) -> bool:
        return self.created(i) + self.retention <= self.now + within

    @property
    def per_day(self) -> int:
        return round(self.n * DAY / self.span)


@dataclass(frozen=True)
class Seeded:
    """One seeded entry of the benchmark's credential, to replay through the proxy."""
    key: str           # the Idempotency-Key an agent sends
    run: str | None
    body: bytes


def _hex(text: str, length: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def entries(t: Template, layout: Layout) -> Iterator[tuple[int, dict]]:
    """(i, {column: value}) for every entry, oldest first. Values keep the template's types."""
    bench_tenant = t.plain["tenant"]
    tenant_len = len(bench_tenant)
    tenants = [_hex(f"bench-tenant-{j}", tenant_len) for j in range(OTHER_TENANTS)]
    body = _as_bytes(t.plain["body"])
    lease = float(t.plain["lease_until"]) - float(t.plain["created_at"])
    counters = dict.fromkeys(SEED_PREFIXES, 0)
    for i in range(layout.n):
        created = layout.created(i)
        if i % 2 == 0 and not layout.is_expired(i, within=REPLAYABLE_FOR):
            p = SEED_PREFIXES[(i // 2) % len(SEED_PREFIXES)]
            counters[p] += 1
            row, tenant, run = dict(t.plain), bench_tenant, None
            key = Scope.agent_key(f"seed-{p}1-{counters[p]}")
            fingerprint = t.plain["fingerprint"]
        else:
            in_run = i % 4 == 1
            row = dict(t.in_run if in_run else t.plain)
            tenant = bench_tenant if i % 10 == 1 else tenants[i % OTHER_TENANTS]
            run = f"run-{i // (STEPS_PER_RUN * 2):07d}" if in_run else None
            key = Scope.agent_key(f"step-{i:08d}")
            fingerprint = (t.plain["fingerprint"] if tenant == bench_tenant
                           else _hex(f"fp{i}", len(t.plain["fingerprint"])))
        row.update(kid=Scope(tenant, run, row["upstream"], key).kid, tenant=tenant, run=run, key=key,
                   fingerprint=fingerprint, created_at=created, completed_at=created + 0.4,
                   lease_until=created + lease, expires_at=created + layout.retention, replays=0, replayed=None,
                   body=body.replace(COMPLETION_ID.encode(), f"chatcmpl-{i:027x}".encode()))
        yield i, row


def probes(t: Template, layout: Layout) -> list[Seeded]:
    """A few seeded entries of the benchmark's credential: the last key of each prefix, and
    a step of a run, found by generating the layout again (it is deterministic)."""
    last: dict[str, Seeded] = {}
    in_run = None
    for i, row in entries(t, layout):
        if row["tenant"] != t.plain["tenant"] or layout.is_expired(i, within=REPLAYABLE_FOR):
            continue
        agent_key = row["key"].removeprefix("key:")
        if row["run"] is None and agent_key.startswith("seed-"):
            last[agent_key[5]] = Seeded(agent_key, None, row["body"])
        elif row["run"] is not None:
            in_run = Seeded(agent_key, row["run"], row["body"])
    return [*last.values(), *([in_run] if in_run else [])]


def _as_bytes(value) -> bytes:
    return value if isinstance(value, bytes) else bytes(value)


# -- SQLite -------------------------------------------------------------------------------

def sqlite_template(url: str, plain_key: str, run_key: str) -> Template:
    with sqlite3.connect(sqlite_path(url)) as conn:
        conn.row_factory = sqlite3.Row
        rows = {r["key"]: dict(r) for r in conn.execute(
            "SELECT * FROM journal WHERE key IN (?, ?)", (Scope.agent_key(plain_key), Scope.agent_key(run_key)))}
    return Template(rows[Scope.agent_key(plain_key)], rows[Scope.agent_key(run_key)])


def sqlite_seed(url: str, t: Template, layout: Layout) -> None:
    columns = list(t.plain)
    insert = f"INSERT INTO journal ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"
    conn = sqlite3.connect(sqlite_path(url), isolation_level=None, timeout=60)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(insert, ([row[c] for c in columns] for _, row in entries(t, layout)))
        conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()


def sqlite_bytes(url: str) -> int:
    """Bytes the file holds in use (pages not on the free list), the WAL checkpointed first."""
    conn = sqlite3.connect(sqlite_path(url), isolation_level=None, timeout=60)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        pages, free, size = (conn.execute(f"PRAGMA {p}").fetchone()[0]
                             for p in ("page_count", "freelist_count", "page_size"))
        return (pages - free) * size
    finally:
        conn.close()


# -- PostgreSQL ---------------------------------------------------------------------------

def postgres_dsn(url: str) -> tuple[str, str]:
    """(asyncpg DSN, schema) from the store's URL (``?schema=`` is the proxy's parameter)."""
    parts = urlsplit(url)
    params = parse_qsl(parts.query)
    schema = dict(params).get("schema", "public")
    return urlunsplit(parts._replace(query=urlencode([(k, v) for k, v in params if k != "schema"]))), schema


async def _pg(url: str, work):
    import asyncpg

    dsn, schema = postgres_dsn(url)
    conn = await asyncpg.connect(dsn, timeout=10, server_settings={"search_path": f'"{schema}"'})
    try:
        return await work(conn, schema)
    finally:
        await conn.close()


def postgres_template(url: str, plain_key: str, run_key: str) -> Template:
    async def work(conn, schema):
        rows = await conn.fetch("SELECT * FROM journal WHERE key = ANY($1::text[])",
                                [Scope.agent_key(plain_key), Scope.agent_key(run_key)])
        return {r["key"]: dict(r) for r in rows}
    rows = asyncio.run(_pg(url, work))
    return Template(rows[Scope.agent_key(plain_key)], rows[Scope.agent_key(run_key)])


async def _ranges_for(url: str, layout: Layout) -> None:
    """The journal's ranges (partitioned by expiry) for every seeded entry, the expired ones too,
    made as the proxy makes them (the default partition_interval, a day)."""
    from idemproxy.proxy.store.postgres import postgres_store

    store = postgres_store(url, retention=layout.retention)
    await store.open()
    try:
        first, last = layout.created(0) + layout.retention, layout.created(layout.n) + layout.retention
        await store.journal.partitions.cover([first + h * 3600.0 for h in range(int((last - first) // 3600) + 2)])
    finally:
        await store.aclose()


def postgres_seed(url: str, t: Template, layout: Layout) -> None:
    columns = list(t.plain)
    asyncio.run(_ranges_for(url, layout))

    async def work(conn, schema):
        await conn.copy_records_to_table("journal", schema_name=schema, columns=columns,
                                         records=([row[c] for c in columns] for _, row in entries(t, layout)))
        # what autovacuum would have done by the time a journal has grown this big
        await conn.execute("VACUUM ANALYZE journal", timeout=600)
    asyncio.run(_pg(url, work))


def postgres_bytes(url: str) -> int:
    """The journal's table, TOAST and indexes (pg_total_relation_size), over its ranges."""
    async def work(conn, schema):
        return await conn.fetchval("SELECT coalesce(sum(pg_total_relation_size(relid)), 0)::bigint "
                                   "FROM pg_partition_tree('journal') WHERE isleaf")
    return asyncio.run(_pg(url, work))


# -- Redis --------------------------------------------------------------------------------

def redis_prefix(url: str) -> str:
    return dict(parse_qsl(urlsplit(url).query)).get("prefix", "idem:")


def _redis(url: str):
    import redis

    parts = urlsplit(url)
    return redis.Redis.from_url(urlunsplit(parts._replace(query="")), socket_timeout=30)


def redis_template(url: str, plain_key: str, run_key: str) -> Template:
    client, prefix = _redis(url), redis_prefix(url)
    try:
        found = {}
        for name in client.scan_iter(match=prefix + "entry:*", count=1000):
            fields = {k.decode(): v for k, v in client.hgetall(name).items()}
            found[fields["key"].decode()] = fields
    finally:
        client.close()
    plain, in_run = found[Scope.agent_key(plain_key)], found[Scope.agent_key(run_key)]
    return Template(*({k: _redis_value(k, v) for k, v in fields.items()} for fields in (plain, in_run)))


def _redis_value(name: str, value: bytes):
    """The template's fields as the generator needs them: numbers and text, bodies as bytes."""
    if name in ("created_at", "lease_until", "expires_at", "completed_at"):
        return float(value)
    return value if name == "body" else value.decode()


def redis_seed(url: str, t: Template, layout: Layout, chunk: int = 2000) -> None:
    """One pipeline per ``chunk`` entries: the hash, its expiry and, in a run, the run's indexes."""
    client, prefix = _redis(url), redis_prefix(url)
    try:
        pipe = client.pipeline(transaction=False)
        for i, row in entries(t, layout):
            kid, expires_ms = row["kid"], int(row["expires_at"] * 1000)
            if row["run"] is not None:
                rk = f"{len(row['namespace'].encode())}:{row['namespace']}:{row['run']}"
                row["rk"] = rk
                pipe.zadd(f"{prefix}steps:{rk}", {kid: row["created_at"]})
                pipe.zadd(f"{prefix}steps-expiry", {f"{kid} {rk}": expires_ms})
            pipe.hset(f"{prefix}entry:{kid}", mapping={k: v if isinstance(v, bytes) else str(v)
                                                      for k, v in row.items() if v is not None})
            pipe.pexpireat(f"{prefix}entry:{kid}", expires_ms)
            if i % chunk == chunk - 1:
                pipe.execute()
        pipe.execute()
    finally:
        client.close()


def redis_bytes(url: str) -> int:
    """used_memory of the whole server: measure on a private one."""
    client = _redis(url)
    try:
        return int(client.info("memory")["used_memory"])
    finally:
        client.close()


SEEDERS = {
    "sqlite": (sqlite_template, sqlite_seed, sqlite_bytes),
    "postgres": (postgres_template, postgres_seed, postgres_bytes),
    "redis": (redis_template, redis_seed, redis_bytes),
}
