"""The SQLite store's tables, and the upgrades that bring an older file to them."""

from __future__ import annotations

import sqlite3

SCHEMA_VERSION = 8
# When a live run is next due to a supervisor (runs.py, silent): past its timeout and its
# grace, at once when its attempt is lost and a hook can start it again, never before its
# backoff (next_restart_at) or a supervisor's claim on it (claimed_until) ends; NULL once it
# ended. Indexed, so a tick reads the runs due and not every run.
DUE_AT = ("CASE WHEN state IN ('running', 'restarting') THEN max("
          "CASE WHEN lost_epoch = epoch AND hook IS NOT NULL THEN 0 "
          "ELSE max(last_seen + timeout_s, started_at + grace_s) END, next_restart_at, claimed_until) END")
SCHEMA = """
CREATE TABLE IF NOT EXISTS journal (
    kid TEXT PRIMARY KEY, tenant TEXT NOT NULL, run TEXT, epoch INTEGER,
    upstream TEXT NOT NULL, key TEXT NOT NULL, fingerprint TEXT NOT NULL,
    method TEXT NOT NULL DEFAULT '', path TEXT NOT NULL DEFAULT '', namespace TEXT NOT NULL,
    state TEXT NOT NULL, owner TEXT, lease_until REAL NOT NULL DEFAULT 0,
    status INTEGER, headers BLOB, body BLOB, streamed INTEGER NOT NULL DEFAULT 0, timing BLOB,
    detail TEXT, created_at REAL NOT NULL, completed_at REAL, expires_at REAL NOT NULL,
    replays INTEGER NOT NULL DEFAULT 0, replayed BLOB, evidence BLOB);
CREATE INDEX IF NOT EXISTS journal_by_run ON journal (namespace, run, created_at);
CREATE INDEX IF NOT EXISTS journal_by_expiry ON journal (expires_at);
CREATE INDEX IF NOT EXISTS journal_quarantined ON journal (expires_at) WHERE state = 'unknown';
CREATE TABLE IF NOT EXISTS partials (
    kid TEXT NOT NULL, seq INTEGER NOT NULL, data BLOB NOT NULL, PRIMARY KEY (kid, seq));
CREATE TABLE IF NOT EXISTS occurrences (
    tenant TEXT NOT NULL, run TEXT NOT NULL, epoch INTEGER NOT NULL, fingerprint TEXT NOT NULL,
    n INTEGER NOT NULL, expires_at REAL NOT NULL, PRIMARY KEY (tenant, run, epoch, fingerprint));
CREATE TABLE IF NOT EXISTS runs (
    tenant TEXT NOT NULL, run_id TEXT NOT NULL, state TEXT NOT NULL, epoch INTEGER NOT NULL,
    restarts INTEGER NOT NULL DEFAULT 0, last_seen REAL NOT NULL, started_at REAL NOT NULL,
    timeout_s REAL NOT NULL, grace_s REAL NOT NULL, max_restarts INTEGER NOT NULL, hook TEXT,
    metadata BLOB, created_at REAL NOT NULL, ended_at REAL, next_restart_at REAL NOT NULL DEFAULT 0,
    history BLOB, restart_times BLOB, lost_epoch INTEGER, attachments INTEGER NOT NULL DEFAULT 0,
    claimed_until REAL NOT NULL DEFAULT 0, due_at REAL GENERATED ALWAYS AS (DUE_AT) VIRTUAL,
    PRIMARY KEY (tenant, run_id));
CREATE INDEX IF NOT EXISTS runs_by_state ON runs (state, last_seen);
CREATE INDEX IF NOT EXISTS runs_due ON runs (due_at) WHERE due_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS secrets (name TEXT PRIMARY KEY, value BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS cache_generation (
    id INTEGER PRIMARY KEY CHECK (id = 0), generation INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS actions (
    at REAL NOT NULL, who TEXT NOT NULL, action TEXT NOT NULL, namespace TEXT, run TEXT, kid TEXT,
    detail BLOB, expires_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS actions_by_kid ON actions (kid);
CREATE INDEX IF NOT EXISTS actions_by_run ON actions (namespace, run);
CREATE INDEX IF NOT EXISTS actions_by_expiry ON actions (expires_at);
CREATE TABLE IF NOT EXISTS refusals (
    namespace TEXT NOT NULL, run TEXT NOT NULL, count INTEGER NOT NULL, recent BLOB NOT NULL,
    expires_at REAL NOT NULL, PRIMARY KEY (namespace, run));
CREATE INDEX IF NOT EXISTS refusals_by_expiry ON refusals (expires_at);
CREATE TABLE IF NOT EXISTS limits (
    name TEXT NOT NULL, bucket INTEGER NOT NULL, n INTEGER NOT NULL, expires_at REAL NOT NULL,
    PRIMARY KEY (name, bucket));
""".replace("DUE_AT", DUE_AT)
# What takes a file made by version N-1 to version N (SCHEMA above is already the latest).
UPGRADES = {2: "ALTER TABLE runs ADD COLUMN restart_times BLOB",
            3: "ALTER TABLE runs ADD COLUMN lost_epoch INTEGER; "
               "ALTER TABLE runs ADD COLUMN attachments INTEGER NOT NULL DEFAULT 0",
            4: "ALTER TABLE journal ADD COLUMN replayed BLOB",  # replays by epoch (Entry.replayed)
            # the journal's invalidation generation (Journal.generation): no row reads as 0
            5: "CREATE TABLE IF NOT EXISTS cache_generation ("
               "id INTEGER PRIMARY KEY CHECK (id = 0), generation INTEGER NOT NULL)",
            # a quarantined call's evidence; operator actions (the audit); quarantined entries counted
            6: "ALTER TABLE journal ADD COLUMN evidence BLOB; "
               "CREATE INDEX IF NOT EXISTS journal_quarantined ON journal (expires_at) WHERE state = 'unknown'; "
               "CREATE TABLE IF NOT EXISTS actions (at REAL NOT NULL, who TEXT NOT NULL, action TEXT NOT NULL, "
               "namespace TEXT, run TEXT, kid TEXT, detail BLOB, expires_at REAL NOT NULL); "
               "CREATE INDEX IF NOT EXISTS actions_by_kid ON actions (kid); "
               "CREATE INDEX IF NOT EXISTS actions_by_run ON actions (namespace, run); "
               "CREATE INDEX IF NOT EXISTS actions_by_expiry ON actions (expires_at)",
            # refusals a run's attempts got, counted per run (Audit.refused); failures and
            # registrations counted across processes (Audit.count_event)
            7: "CREATE TABLE IF NOT EXISTS refusals (namespace TEXT NOT NULL, run TEXT NOT NULL, "
               "count INTEGER NOT NULL, recent BLOB NOT NULL, expires_at REAL NOT NULL, PRIMARY KEY (namespace, run)); "
               "CREATE INDEX IF NOT EXISTS refusals_by_expiry ON refusals (expires_at); "
               "CREATE TABLE IF NOT EXISTS limits (name TEXT NOT NULL, bucket INTEGER NOT NULL, "
               "n INTEGER NOT NULL, expires_at REAL NOT NULL, PRIMARY KEY (name, bucket))",
            # when each live run is due to a supervisor, indexed (DUE_AT)
            8: "ALTER TABLE runs ADD COLUMN claimed_until REAL NOT NULL DEFAULT 0; "
               f"ALTER TABLE runs ADD COLUMN due_at REAL GENERATED ALWAYS AS ({DUE_AT}) VIRTUAL; "
               "CREATE INDEX IF NOT EXISTS runs_due ON runs (due_at) WHERE due_at IS NOT NULL"}


def migrate(conn: sqlite3.Connection) -> None:
    """Bring the file to SCHEMA_VERSION. In one write transaction: workers opening the same
    file together queue here, and the first one's work is what the others find done."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version == 0:
            statements = SCHEMA.split(";")
        else:
            statements = [s for v in range(version + 1, SCHEMA_VERSION + 1) for s in UPGRADES[v].split(";")]
        for statement in statements:
            if statement.strip():
                conn.execute(statement)
        if version < SCHEMA_VERSION:
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
