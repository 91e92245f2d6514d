"""The migration that partitions the journal by expiry, and the claim it needs.

Why by ``expires_at``: every entry carries its own expiry (``created_at + retention_s``,
and a claim's retention is the caller's to choose), so a partition whose range lies wholly
before now holds only expired entries, whatever their retention was: dropping it is
exact. Partitioned by ``created_at`` that would hold only under one uniform retention.
An entry's expiry is never changed after its claim (a takeover writes a new row), so no
row ever moves between partitions.

Why a claim takes a lock per key: a unique index on a partitioned table must include the
partition key, so ``(kid)`` alone can no longer be unique, and ``INSERT … ON CONFLICT
(kid)`` cannot serialize two claims of one key. :data:`CLAIM_FUNCTION` takes
``pg_advisory_xact_lock`` on each asked kid's hash (in hash order: claims sharing keys
never wait in a cycle, and nothing else takes these locks), then reads and writes in a
statement of its own: under READ COMMITTED that statement's snapshot is taken after the
locks, so it sees every claim of the same keys committed before it. Invariant: at most
one row per kid has ``expires_at > now``; expired rows of a kid stay, unread, until their
partition is dropped.

The other tables are not partitioned. The runs registry rewrites a run's row all its life
(``last_seen`` at every heartbeat), so a time key would move rows between partitions at
every beat; it holds a row per run, not per call, and its purge deletes ended runs in
batches. Occurrence counters extend their expiry at every use (the same objection); the
stream bytes (``partials``) only ever hold calls in flight.

The migration is metadata plus one scan: today's ``journal`` is renamed and attached as
the first partition, ``[MINVALUE, its last expiry)``, so no row is copied; that range is
dropped whole once its last entry expires. The scan is PostgreSQL's check that every row
lies in that range (docs/sizing.md gives its time per million entries).
"""

from __future__ import annotations

import asyncpg

from ..model import EntryState

ENTRY_COLUMNS = ("kid, tenant, run, epoch, upstream, key, fingerprint, state, owner, lease_until, "
                 "created_at, completed_at, expires_at, replays, detail, method, path, namespace")

# $1 one claim_row each, $2 now, $3 take over an expired lease (on_expired == "retry"); as
# sql.CLAIM_MANY before this migration, with the key locks first. A winner replaces the
# unexpired entry that was not live (one an operator retried, or a dead proxy's lapsed claim
# under "retry"): that row is deleted, re-checked against a concurrent record, and the new
# one inserted only when the old one is gone.
CLAIM_FUNCTION = f"""
CREATE OR REPLACE FUNCTION claim_many(claim_row[], DOUBLE PRECISION, BOOLEAN)
RETURNS TABLE (asked TEXT, won BOOLEAN, run_epoch BIGINT, kid TEXT, tenant TEXT, run TEXT, epoch BIGINT,
    upstream TEXT, key TEXT, fingerprint TEXT, state TEXT, owner TEXT, lease_until DOUBLE PRECISION,
    created_at DOUBLE PRECISION, completed_at DOUBLE PRECISION, expires_at DOUBLE PRECISION, replays BIGINT,
    detail TEXT, method TEXT, path TEXT, namespace TEXT, status INTEGER, headers JSONB, body BYTEA,
    streamed BOOLEAN, timing JSONB)
LANGUAGE plpgsql VOLATILE AS $claim$
#variable_conflict use_column
BEGIN
    PERFORM pg_advisory_xact_lock(h) FROM (
        SELECT DISTINCT hashtextextended(a.kid, 0) AS h FROM unnest($1) AS a ORDER BY 1) AS locks;
    IF $3 THEN  -- sql.CLAIM_MANY says why a claim under "retry" skips the WAL flush
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    RETURN QUERY
    WITH c AS (SELECT * FROM unnest($1)),
    present AS (
        SELECT j.* FROM c, LATERAL (
            SELECT {ENTRY_COLUMNS}, status, headers, body, streamed, timing FROM journal
            WHERE journal.kid = c.kid AND journal.expires_at > $2 LIMIT 1) AS j),
    live AS (
        SELECT p.* FROM present p JOIN c ON c.kid = p.kid
        WHERE p.state <> '{EntryState.RETRIED}'
          AND NOT ($3 AND p.state = '{EntryState.IN_FLIGHT}' AND p.lease_until <= $2
                   AND p.fingerprint = c.fingerprint)),
    asks AS (SELECT * FROM c WHERE c.kid NOT IN (SELECT live.kid FROM live)),
    fence AS (
        SELECT r.tenant, r.run_id, r.epoch FROM runs r
        WHERE (r.tenant, r.run_id) IN (SELECT a.namespace, a.run FROM asks a WHERE a.epoch IS NOT NULL)
        ORDER BY r.tenant COLLATE "C", r.run_id COLLATE "C" FOR SHARE),
    winners AS (
        SELECT * FROM asks a WHERE NOT EXISTS (
            SELECT 1 FROM fence f WHERE f.tenant = a.namespace AND f.run_id = a.run AND f.epoch > a.epoch)),
    -- only a key present can be replaced: a new key's claim then probes the ranges once, not twice
    replaced AS (
        DELETE FROM journal j USING winners w
        WHERE w.kid IN (SELECT p.kid FROM present p)
          AND j.kid = w.kid AND j.expires_at > $2 AND (j.state = '{EntryState.RETRIED}' OR ($3
              AND j.state = '{EntryState.IN_FLIGHT}' AND j.lease_until <= $2 AND j.fingerprint = w.fingerprint))
        RETURNING j.kid),
    claimed AS (
        INSERT INTO journal (kid, tenant, run, epoch, upstream, key, fingerprint, method, path, namespace,
                             state, owner, lease_until, created_at, expires_at)
        SELECT w.kid, w.tenant, w.run, w.epoch, w.upstream, w.key, w.fingerprint, w.method, w.path,
               w.namespace, '{EntryState.IN_FLIGHT}', w.owner, w.lease_until, w.created_at, w.expires_at
        FROM winners w
        WHERE w.kid NOT IN (SELECT p.kid FROM present p) OR w.kid IN (SELECT r.kid FROM replaced r)
        ORDER BY w.kid
        RETURNING journal.kid),
    -- a new claim, or a takeover: bytes a dead call left behind must not be joined
    dropped AS (DELETE FROM partials WHERE partials.kid IN (SELECT cl.kid FROM claimed cl))
    SELECT c.kid, c.kid IN (SELECT cl.kid FROM claimed cl),
           CASE WHEN c.epoch IS NOT NULL THEN
               coalesce((SELECT f.epoch FROM fence f WHERE f.tenant = c.namespace AND f.run_id = c.run),
                        (SELECT r.epoch FROM runs r WHERE r.tenant = c.namespace AND r.run_id = c.run))
           END,
           live.*
    FROM c LEFT JOIN live ON live.kid = c.kid;
END
$claim$"""

# The first range (the journal before this migration) keeps its primary key on kid, and
# new entries that expire before its bound land in it (a retention made shorter than it
# was): a key's expired row there, never read again and kept until the range is dropped,
# would refuse the key's next claim. $1 kids, $2 now: those rows, deleted when that
# happens (journal.py), as the range's drop would.
FORGET_EXPIRED_IN_FIRST_RANGE = """
DELETE FROM journal_unpartitioned WHERE kid = ANY($1::text[]) AND expires_at <= $2"""


def is_first_range_key(exc: BaseException) -> bool:
    """A claim refused by the first range's primary key (FORGET_EXPIRED_IN_FIRST_RANGE)."""
    return (isinstance(exc, asyncpg.UniqueViolationError)
            and getattr(exc, "constraint_name", None) == "journal_unpartitioned_pkey")


# Applied under the migration lock, in its transaction. The kid index is declared on the
# parent only (ON ONLY): the old table keeps its primary key for its lookups by kid, and
# every partition created since gets the index from the parent.
PARTITION_JOURNAL = f"""
ALTER TABLE journal RENAME TO journal_unpartitioned;
ALTER INDEX journal_pkey RENAME TO journal_unpartitioned_pkey;
ALTER INDEX journal_by_run RENAME TO journal_unpartitioned_by_run;
ALTER INDEX journal_quarantined RENAME TO journal_unpartitioned_quarantined;
-- a partition's range is what expires: the index on expiry has nothing left to do
DROP INDEX journal_by_expiry;
CREATE TABLE journal (LIKE journal_unpartitioned INCLUDING DEFAULTS) PARTITION BY RANGE (expires_at);
DO $attach$ DECLARE bound DOUBLE PRECISION; BEGIN
    IF NOT EXISTS (SELECT 1 FROM journal_unpartitioned) THEN  -- a new deployment: nothing to keep
        DROP TABLE journal_unpartitioned;
        RETURN;
    END IF;
    SELECT max(expires_at) + 1 INTO bound FROM journal_unpartitioned;
    EXECUTE format('ALTER TABLE journal ATTACH PARTITION journal_unpartitioned FOR VALUES FROM (MINVALUE) TO (%L)',
                   bound);
END $attach$;
CREATE INDEX journal_by_kid ON ONLY journal (kid);
CREATE INDEX journal_by_run ON journal (namespace, run, created_at);
CREATE INDEX journal_quarantined ON journal (expires_at) WHERE state = 'unknown';
{CLAIM_FUNCTION};
"""
