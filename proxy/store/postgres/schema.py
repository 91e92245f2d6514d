"""The PostgreSQL store's schema: numbered migrations, applied at open under an advisory lock."""

from __future__ import annotations

import hashlib

import asyncpg

from ..errors import SchemaNotCurrent
from .partitioned import CLAIM_FUNCTION, PARTITION_JOURNAL

# Append only: a deployed migration never changes; the next change is version N+1.
MIGRATIONS: list[tuple[int, str]] = [(1, """
CREATE TABLE journal (
    kid TEXT PRIMARY KEY, tenant TEXT NOT NULL, run TEXT, epoch BIGINT,
    upstream TEXT NOT NULL, key TEXT NOT NULL, fingerprint TEXT NOT NULL,
    method TEXT NOT NULL DEFAULT '', path TEXT NOT NULL DEFAULT '', namespace TEXT NOT NULL,
    state TEXT NOT NULL, owner TEXT, lease_until DOUBLE PRECISION NOT NULL DEFAULT 0,
    status INTEGER, headers JSONB, body BYTEA, streamed BOOLEAN NOT NULL DEFAULT false, timing JSONB,
    detail TEXT, created_at DOUBLE PRECISION NOT NULL, completed_at DOUBLE PRECISION,
    expires_at DOUBLE PRECISION NOT NULL, replays BIGINT NOT NULL DEFAULT 0);
CREATE INDEX journal_by_run ON journal (namespace, run, created_at);
CREATE INDEX journal_by_expiry ON journal (expires_at);
CREATE TABLE partials (kid TEXT NOT NULL, seq INTEGER NOT NULL, data BYTEA NOT NULL, PRIMARY KEY (kid, seq));
-- "tenant" of occurrences and runs is the run's namespace
CREATE TABLE occurrences (
    tenant TEXT NOT NULL, run TEXT NOT NULL, epoch BIGINT NOT NULL, fingerprint TEXT NOT NULL,
    n BIGINT NOT NULL, expires_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (tenant, run, epoch, fingerprint));
CREATE INDEX occurrences_by_expiry ON occurrences (expires_at);
CREATE TABLE runs (
    tenant TEXT NOT NULL, run_id TEXT NOT NULL, state TEXT NOT NULL, epoch BIGINT NOT NULL,
    restarts INTEGER NOT NULL DEFAULT 0, last_seen DOUBLE PRECISION NOT NULL,
    started_at DOUBLE PRECISION NOT NULL, timeout_s DOUBLE PRECISION NOT NULL,
    grace_s DOUBLE PRECISION NOT NULL, max_restarts INTEGER NOT NULL, hook TEXT, metadata JSONB,
    created_at DOUBLE PRECISION NOT NULL, ended_at DOUBLE PRECISION,
    next_restart_at DOUBLE PRECISION NOT NULL DEFAULT 0, history JSONB, PRIMARY KEY (tenant, run_id));
CREATE INDEX runs_by_state ON runs (state, last_seen);
CREATE TABLE secrets (name TEXT PRIMARY KEY, value BYTEA NOT NULL);
"""), (2, """
-- the restarts that count towards max_restarts, apart from the history that evicts them
ALTER TABLE runs ADD COLUMN restart_times JSONB NOT NULL DEFAULT '[]';
"""), (3, """
-- an attempt found lost (exited, or its held connection gone), and the connections held so far
ALTER TABLE runs ADD COLUMN lost_epoch BIGINT;
ALTER TABLE runs ADD COLUMN attachments BIGINT NOT NULL DEFAULT 0;
"""), (4, """
-- replays by the epoch of their run, {"epoch": [replays, first seen]}: the console's timeline
ALTER TABLE journal ADD COLUMN replayed JSONB;
"""), (5, """
-- the journal's invalidation generation (Journal.generation): no row reads as 0
CREATE TABLE cache_generation (id INTEGER PRIMARY KEY CHECK (id = 0), generation BIGINT NOT NULL);
"""), (6, """
-- a batch of claims or records is sent as one array of these rows, not one array per column:
-- asyncpg tests every element of an array for being an array itself, two isinstance() checks
-- per text, and a row once (sql.CLAIM_MANY)
CREATE TYPE claim_row AS (
    kid TEXT, tenant TEXT, run TEXT, epoch BIGINT, upstream TEXT, key TEXT, fingerprint TEXT,
    method TEXT, path TEXT, owner TEXT, lease_until DOUBLE PRECISION, created_at DOUBLE PRECISION,
    expires_at DOUBLE PRECISION, namespace TEXT);
CREATE TYPE record_row AS (
    kid TEXT, owner TEXT, status INTEGER, headers TEXT, body BYTEA, streamed BOOLEAN, timing TEXT);
"""), (7, """
-- what an operator needs to decide a quarantined call (Entry.evidence), and quarantined
-- entries counted for /metrics without a scan
ALTER TABLE journal ADD COLUMN evidence JSONB;
CREATE INDEX journal_quarantined ON journal (expires_at) WHERE state = 'unknown';
-- operator actions (SPEC §16), kept for the journal's retention
CREATE TABLE actions (
    id BIGSERIAL PRIMARY KEY, at DOUBLE PRECISION NOT NULL, who TEXT NOT NULL, action TEXT NOT NULL,
    namespace TEXT, run TEXT, kid TEXT, detail JSONB NOT NULL DEFAULT '{}',
    expires_at DOUBLE PRECISION NOT NULL);
CREATE INDEX actions_by_kid ON actions (kid);
CREATE INDEX actions_by_run ON actions (namespace, run);
CREATE INDEX actions_by_expiry ON actions (expires_at);
"""), (8, """
-- When a live run is next due to a supervisor (sql.SILENT_RUNS): past its timeout and its
-- grace, at once when its attempt is lost and a hook can start it again, never before its
-- backoff (next_restart_at) or a supervisor's claim on it (claimed_until) ends; NULL once it
-- ended. Indexed, so a tick reads the runs due and not every run.
ALTER TABLE runs ADD COLUMN claimed_until DOUBLE PRECISION NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN due_at DOUBLE PRECISION GENERATED ALWAYS AS (
    CASE WHEN state IN ('running', 'restarting') THEN greatest(
        CASE WHEN lost_epoch = epoch AND hook IS NOT NULL THEN 0
             ELSE greatest(last_seen + timeout_s, started_at + grace_s) END,
        next_restart_at, claimed_until) END) STORED;
CREATE INDEX runs_due ON runs (due_at) WHERE due_at IS NOT NULL;
"""), (9, """
-- the refusals a run's attempts got: how many, and the last few (Audit.refused)
CREATE TABLE refusals (
    namespace TEXT NOT NULL, run TEXT NOT NULL, count BIGINT NOT NULL, recent JSONB NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (namespace, run));
CREATE INDEX refusals_by_expiry ON refusals (expires_at);
-- wrong admin tokens and registrations, counted across replicas in fixed windows (Audit.count_event)
CREATE TABLE limits (
    name TEXT NOT NULL, bucket BIGINT NOT NULL, n BIGINT NOT NULL, expires_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (name, bucket));
"""), (10, PARTITION_JOURNAL),  # the journal partitioned by expiry: partitioned.py
    (11, CLAIM_FUNCTION)]  # a new key's claim probes the ranges once (as created by 10 since)


async def check(conn: asyncpg.Connection, schema: str) -> None:
    """Raise SchemaNotCurrent unless ``schema`` has every migration; reads only."""
    table = f'"{schema}".schema_migrations'
    if not await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", table):
        raise SchemaNotCurrent(f"no idemproxy tables in schema {schema}")
    done = {r[0] for r in await conn.fetch(f"SELECT version FROM {table}")}
    missing = [version for version, _ in MIGRATIONS if version not in done]
    if missing:
        raise SchemaNotCurrent(f"schema {schema} lacks migration(s) {', '.join(map(str, missing))}")


async def migrate(conn: asyncpg.Connection, schema: str, timeout: float) -> list[int]:
    """Bring ``schema`` up to the last migration; the versions applied now."""
    applied = []
    async with conn.transaction():
        # Replicas starting together queue here; the first applies, the rest find it done.
        key = int.from_bytes(hashlib.sha256(f"idemproxy:{schema}".encode()).digest()[:8], "big", signed=True)
        await conn.execute("SELECT pg_advisory_xact_lock($1)", key, timeout=timeout)
        # IF NOT EXISTS alone would still need the CREATE privilege on the database
        if not await conn.fetchval("SELECT 1 FROM pg_namespace WHERE nspname = $1", schema):
            await conn.execute(f'CREATE SCHEMA "{schema}"')
        await conn.execute(f'SET LOCAL search_path TO "{schema}"')
        await conn.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, "
                           "applied_at TIMESTAMPTZ NOT NULL DEFAULT now())")
        done = {r[0] for r in await conn.fetch("SELECT version FROM schema_migrations")}
        for version, statements in MIGRATIONS:
            if version not in done:
                await conn.execute(statements, timeout=timeout)
                await conn.execute("INSERT INTO schema_migrations (version) VALUES ($1)", version)
                applied.append(version)
    return applied
