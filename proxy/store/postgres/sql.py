"""The PostgreSQL store's statements.

Statements that settle a journal entry notify its kid on the store's channel
(``RETURNING pg_notify(channel, kid)``): PostgreSQL delivers it at commit, so a waiter
never hears of a change before it is durable. Positional parameters are listed above
each statement.
"""

from __future__ import annotations

from ..model import ANSWERED_BY_OPERATOR, EntryState, RunState
from ..rules import HISTORY_LIMIT
from ..waking import RUN_LOST

ENTRY_COLUMNS = ("kid, tenant, run, epoch, upstream, key, fingerprint, state, owner, lease_until, "
                 "created_at, completed_at, expires_at, replays, detail, method, path, namespace")
RUN_COLUMNS = ("tenant, run_id, state, epoch, restarts, last_seen, started_at, timeout_s, grace_s, "
               "max_restarts, hook, metadata, created_at, ended_at, next_restart_at, history, restart_times, "
               "lost_epoch, attachments")

# Claims that arrived together: $1 one claim_row each (schema.py), $2 now, $3 take over an
# expired lease (on_expired == "retry"). Kids are distinct. (One array of rows, not an
# array per column: asyncpg checks each element of an array for being an array itself,
# with two isinstance() calls per text: 10% of a PostgreSQL record's instructions.)
# A key with a live entry (one not to take over) is answered with that entry and not
# written at all: a replay costs a read and its key's lock (in memory), no commit to disk.
# The others are inserted in kid order, after each asked key's lock is taken
# (partitioned.py: the journal is partitioned, so no unique index serializes two claims
# of one key).
# Their runs' epochs are read FOR SHARE, in byte order as the heartbeats lock them: a
# restart raising one waits for this claim to commit, or this claim waits for the
# restart and sees the new epoch. Either way no fenced attempt holds a key.
# One row per claim: its kid, won, the run's epoch when the claim is fenced, then the
# live entry's columns (NULL when there is none).
# Under "retry" ($3) the claims commit without waiting for the WAL flush: a claim that a
# server crash lost and one whose proxy died both end in the next try going upstream
# again (the lapsed one after its lease), so waiting bought nothing. A proxy's crash loses
# neither; the record that answers the agent is always flushed. Under "quarantine" a
# claim must outlive a crash, to quarantine its key.
CLAIM_MANY = "SELECT * FROM claim_many($1::claim_row[], $2, $3)"  # partitioned.CLAIM_FUNCTION

# $1 kid, $2 now, $3 detail, $4 fingerprint, $5 channel: a dead proxy's claim under "quarantine"
QUARANTINE_EXPIRED = f"""
UPDATE journal SET state = '{EntryState.UNKNOWN}', owner = NULL, detail = $3
WHERE kid = $1 AND state = '{EntryState.IN_FLIGHT}' AND lease_until <= $2 AND expires_at > $2 AND fingerprint = $4
RETURNING {ENTRY_COLUMNS}, pg_notify($5, kid)"""

# $1 one record_row per record (schema.py: as CLAIM_MANY's claim rows), $2 now, $3 channel,
# $4 and $5 each record's bounds of its entry's expiry (journal.py, _Held): each row is looked
# for in its own range, not in every live one.
COMPLETE_MANY = f"""
WITH r AS (SELECT * FROM unnest($1::record_row[]) WITH ORDINALITY),
b AS (SELECT * FROM unnest($4::float8[], $5::float8[]) WITH ORDINALITY AS b(expires_from, expires_to, ordinality)),
u AS (SELECT r.*, b.expires_from, b.expires_to FROM r JOIN b USING (ordinality)),
done AS (
    UPDATE journal j SET state = '{EntryState.COMPLETE}', owner = NULL, status = u.status,
        headers = u.headers::jsonb, body = u.body, streamed = u.streamed, timing = u.timing::jsonb,
        completed_at = $2
    FROM u
    WHERE j.kid = u.kid AND j.owner = u.owner AND j.state = '{EntryState.IN_FLIGHT}'
      AND j.expires_at BETWEEN u.expires_from AND u.expires_to
    RETURNING j.kid, u.owner),
dropped AS (DELETE FROM partials WHERE kid IN (SELECT kid FROM u)),
-- one notification per hundred kids, not one each (a payload holds 8000 bytes)
told AS (SELECT pg_notify($3, string_agg(kid, ' ')) FROM (
    SELECT kid, (row_number() OVER ()) / 100 AS chunk FROM done) AS d GROUP BY chunk)
SELECT kid, owner FROM done WHERE (SELECT count(*) FROM told) >= 0  -- (which sends them)"""

# $1 kid, $2 owner, $3 channel, $4 and $5 the bounds of the entry's expiry (as COMPLETE_MANY)
RELEASE = """
WITH gone AS (
    DELETE FROM journal WHERE kid = $1 AND owner = $2 AND expires_at BETWEEN $4 AND $5
    RETURNING namespace, run, coalesce(epoch, -1) AS epoch, tenant, fingerprint, key, pg_notify($3, kid)),
dropped AS (DELETE FROM partials WHERE kid = $1)
-- give a derived key's occurrence number back, so the caller's retry maps onto this slot
-- (counters are kept under base.counted(tenant, fingerprint): "{tenant} {fingerprint}")
UPDATE occurrences o SET n = o.n - 1 FROM gone
WHERE gone.key LIKE 'derived:%' AND o.tenant = gone.namespace AND o.run = gone.run
  AND o.epoch = gone.epoch AND o.fingerprint = gone.tenant || ' ' || gone.fingerprint
  AND o.n = substring(gone.key from ':([0-9]+)$')::bigint + 1"""

# $1 kid, $2 state, $3 detail, $4 owner (NULL: whoever holds it), $5 channel, $6 evidence, $7 now.
# Statements by kid alone read "expires_at > now": a kid's expired rows stay until their
# partition is dropped (partitioned.py).
SET_STATE = """
WITH changed AS (
    UPDATE journal SET state = $2, owner = NULL, detail = $3, evidence = $6
    WHERE kid = $1 AND ($4::text IS NULL OR owner = $4) AND expires_at > $7
    RETURNING pg_notify($5, kid))
DELETE FROM partials WHERE kid = $1"""

# $1 kid, $2 channel, $3 now: kept, findable; the next claim of its key takes it over (CLAIM_MANY)
RESOLVE_AS_RETRY = f"""
WITH changed AS (
    UPDATE journal SET state = '{EntryState.RETRIED}'
    WHERE kid = $1 AND state = '{EntryState.UNKNOWN}' AND expires_at > $3
    RETURNING pg_notify($2, kid)),
dropped AS (DELETE FROM partials WHERE kid = $1)
SELECT * FROM changed"""
# $1 kid, $2 status, $3 headers, $4 body, $5 now, $6 channel
RESOLVE_WITH_ANSWER = f"""
UPDATE journal SET state = '{EntryState.COMPLETE}', status = $2, headers = $3, body = $4, streamed = false,
    completed_at = $5, detail = '{ANSWERED_BY_OPERATOR}'
WHERE kid = $1 AND state = '{EntryState.UNKNOWN}' AND expires_at > $5 RETURNING pg_notify($6, kid)"""

# $1 kid, $2 seq, $3 data, $4 channel
APPEND_PARTIAL = ("INSERT INTO partials (kid, seq, data) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING "
                  "RETURNING pg_notify($4, kid)")

# $1 now, $2 batch (the journal itself is purged by dropping partitions: partitions.py)
PURGE_OCCURRENCES = """
DELETE FROM occurrences WHERE ctid IN (SELECT ctid FROM occurrences WHERE expires_at <= $1 LIMIT $2)"""

# $1 namespace, $2 run
DELETE_JOURNAL = """
WITH p AS (DELETE FROM partials WHERE kid IN (SELECT kid FROM journal WHERE namespace = $1 AND run = $2)),
o AS (DELETE FROM occurrences WHERE tenant = $1 AND run = $2),
j AS (DELETE FROM journal WHERE namespace = $1 AND run = $2 RETURNING kid),
g AS (INSERT INTO cache_generation (id, generation) VALUES (0, 1)
      ON CONFLICT (id) DO UPDATE SET generation = cache_generation.generation + 1)
SELECT count(*) FROM j"""
GENERATION = "SELECT generation FROM cache_generation"

# -- operator actions (audit.py) ------------------------------------------------------------
ACTION_COLUMNS = "at, who, action, namespace, run, kid, detail"
# $1..$7 ACTION_COLUMNS, $8 expires_at
NOTE_ACTION = f"INSERT INTO actions ({ACTION_COLUMNS}, expires_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"
ACTIONS_OF_ENTRY = f"SELECT {ACTION_COLUMNS} FROM actions WHERE kid = $1 AND expires_at > $2 ORDER BY at, id"
ACTIONS_OF_RUN = (f"SELECT {ACTION_COLUMNS} FROM actions WHERE namespace = $1 AND run = $2 AND expires_at > $3 "
                  "ORDER BY at, id")
PURGE_ACTIONS = "DELETE FROM actions WHERE expires_at <= $1"
# $1 namespace, $2 run, $3 the refusal (JSON), $4 how many to keep, $5 expires_at
NOTE_REFUSAL = """
INSERT INTO refusals AS r (namespace, run, count, recent, expires_at)
VALUES ($1, $2, 1, jsonb_build_array($3::jsonb), $5)
ON CONFLICT (namespace, run) DO UPDATE SET count = r.count + 1, expires_at = excluded.expires_at,
    recent = CASE WHEN jsonb_array_length(r.recent) >= $4 THEN (r.recent - 0) || jsonb_build_array($3::jsonb)
             ELSE r.recent || jsonb_build_array($3::jsonb) END"""
REFUSALS_OF_RUN = "SELECT count, recent FROM refusals WHERE namespace = $1 AND run = $2 AND expires_at > $3"
PURGE_REFUSALS = "DELETE FROM refusals WHERE expires_at <= $1"
# $1 names (sorted: replicas counting the same names lock their rows in one order), $2 bucket,
# $3 expires_at
COUNT_EVENTS = """
INSERT INTO limits AS l (name, bucket, n, expires_at) SELECT name, $2, 1, $3 FROM unnest($1::text[]) AS name
ON CONFLICT (name, bucket) DO UPDATE SET n = l.n + 1"""
# $1 name, $2 the first bucket: (bucket, n) of the buckets since
EVENTS_SINCE = "SELECT bucket, n FROM limits WHERE name = $1 AND bucket >= $2"
PURGE_LIMITS = "DELETE FROM limits WHERE expires_at <= $1"

# $1..$19: the columns of RUN_COLUMNS, in order
UPSERT_RUN = f"""
INSERT INTO runs ({RUN_COLUMNS})
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19)
ON CONFLICT (tenant, run_id) DO UPDATE SET timeout_s = excluded.timeout_s, grace_s = excluded.grace_s,
    max_restarts = excluded.max_restarts, hook = excluded.hook, metadata = excluded.metadata
RETURNING {RUN_COLUMNS}"""

# $1 namespace, $2 run_id, $3 epoch, $4 now, then the defaults of a new run: $5 timeout_s,
# $6 grace_s, $7 max_restarts, $8 hook, $9 metadata; $10 the ended event of the attempt a
# raise supersedes (NULL: none), appended to the history as base.remembered does. A new run
# only at epoch 0 or 1; an existing one moves to the next epoch only. Returns nothing when
# nothing was written.
RAISE_EPOCH = f"""
INSERT INTO runs ({RUN_COLUMNS})
SELECT $1, $2, '{RunState.RUNNING}', $3::bigint, 0, $4, $4, $5, $6, $7, $8, $9, $4, NULL, 0, '[]', '[]', NULL, 0
WHERE $3::bigint <= 1 OR EXISTS (SELECT 1 FROM runs WHERE tenant = $1 AND run_id = $2)
ON CONFLICT (tenant, run_id) DO UPDATE SET epoch = excluded.epoch, started_at = excluded.started_at,
    state = CASE WHEN runs.state = '{RunState.RESTARTING}' THEN '{RunState.RUNNING}' ELSE runs.state END,
    history = CASE WHEN $10::jsonb IS NULL THEN runs.history ELSE (
        SELECT jsonb_agg(e ORDER BY i) FROM jsonb_array_elements(coalesce(runs.history, '[]') || $10::jsonb)
        WITH ORDINALITY AS kept(e, i)
        WHERE i > jsonb_array_length(coalesce(runs.history, '[]') || $10::jsonb) - {HISTORY_LIMIT}) END
WHERE excluded.epoch = runs.epoch + 1
RETURNING epoch"""

# $1 at, $2 namespace, $3 run_id. Traffic after a restart means the new attempt is up.
TOUCH = f"""
UPDATE runs SET last_seen = greatest(last_seen, $1),
    state = CASE WHEN state = '{RunState.RESTARTING}' THEN '{RunState.RUNNING}' ELSE state END
WHERE tenant = $2 AND run_id = $3 AND ($4::bigint IS NULL OR epoch <= $4)"""
# $1 namespaces, $2 run ids (arrays of the same length), $3 now
COUNT_STEPS = """
SELECT j.namespace, j.run, count(*) FROM journal j
JOIN (SELECT DISTINCT * FROM unnest($1::text[], $2::text[])) AS w(namespace, run)
  ON j.namespace = w.namespace AND j.run = w.run
WHERE j.expires_at > $3
GROUP BY j.namespace, j.run"""

# -- short statements, named so the store reads as what it does ---------------------------
# $1 kids, $2 now: the live entries among several (gets that arrived together). One index
# probe per kid and live range: LIMIT 1 keeps the planner from turning the lookups into a
# join that reads every live entry.
GET_MANY = (f"SELECT j.* FROM unnest($1::text[]) AS wanted(kid), LATERAL ("
            f"SELECT {ENTRY_COLUMNS}, status, headers, body, streamed, timing, evidence FROM journal "
            "WHERE journal.kid = wanted.kid AND expires_at > $2 LIMIT 1) AS j")
# The no-op update makes RETURNING give the value that was there first.
SECRET = ("INSERT INTO secrets (name, value) VALUES ($1, $2) "
          "ON CONFLICT (name) DO UPDATE SET value = secrets.value RETURNING value")
NEXT_OCCURRENCE = ("INSERT INTO occurrences (tenant, run, epoch, fingerprint, n, expires_at) "
                   "VALUES ($1, $2, $3, $4, 1, $5) ON CONFLICT (tenant, run, epoch, fingerprint) "
                   "DO UPDATE SET n = occurrences.n + 1, expires_at = excluded.expires_at RETURNING n")
# $1 namespace, $2 run, $3 epoch, $4 fingerprint, $5 expires_at: next_occurrence, counted
# only while the run is at $3, and committed without waiting for the WAL flush (local to
# this statement's transaction: the session keeps synchronous_commit as it was).
REPLAY_OCCURRENCE = """
WITH relaxed AS (SELECT set_config('synchronous_commit', 'off', true)),
counted AS (
    INSERT INTO occurrences (tenant, run, epoch, fingerprint, n, expires_at)
    SELECT $1, $2, $3, $4, 1, $5 FROM runs
    WHERE tenant = $1 AND run_id = $2 AND epoch = $3 AND (SELECT count(*) FROM relaxed) = 1
    ON CONFLICT (tenant, run, epoch, fingerprint)
    DO UPDATE SET n = occurrences.n + 1, expires_at = excluded.expires_at RETURNING n)
SELECT n FROM counted"""
# $1 namespace, $2 run, $3 now, $4 max_bytes: complete entries, oldest first, with a running
# total of their bodies, up to the first one past max_bytes (which the caller drops)
RECORDED = f"""
SELECT * FROM (
    SELECT {ENTRY_COLUMNS}, status, headers, body, streamed, timing,
           sum(octet_length(body)) OVER (ORDER BY created_at, kid) AS upto
    FROM journal WHERE namespace = $1 AND run = $2 AND state = '{EntryState.COMPLETE}' AND expires_at > $3
) AS r WHERE upto - octet_length(body) <= $4"""
RENEW = (f"UPDATE journal SET lease_until = $1 WHERE kid = $2 AND owner = $3 AND state = '{EntryState.IN_FLIGHT}' "
         "AND expires_at BETWEEN $4 AND $5")  # $4, $5: as RELEASE
READ_PARTIAL = "SELECT seq, data FROM partials WHERE kid = $1 AND seq > $2 ORDER BY seq"
# $1 replays, $2 kid, $3 now: tallied under the current epoch of the entry's run
COUNT_REPLAYS = """
UPDATE journal j SET replays = j.replays + $1, replayed = coalesce(j.replayed, '{}') || coalesce((
    SELECT jsonb_build_object(r.epoch::text, jsonb_build_array(
        coalesce((j.replayed -> r.epoch::text ->> 0)::bigint, 0) + $1,
        coalesce((j.replayed -> r.epoch::text ->> 1)::float8, $3)))
    FROM runs r WHERE r.tenant = j.namespace AND r.run_id = j.run), '{}')
WHERE j.kid = $2 AND j.expires_at > $3"""
JOURNAL = (f"SELECT {ENTRY_COLUMNS}, status, replayed FROM journal WHERE namespace = $1 AND run = $2 "
           "AND expires_at > $3 ORDER BY created_at")
# $1 now, then filters (NULL: any) $2 state, $3 key, $4 tenant, $5 run; $6 limit. For operators: may scan.
SEARCH = (f"SELECT {ENTRY_COLUMNS}, status, replayed FROM journal WHERE expires_at > $1 "
          "AND ($2::text IS NULL OR state = $2) AND ($3::text IS NULL OR key = $3) "
          "AND ($4::text IS NULL OR tenant = $4) AND ($5::text IS NULL OR run = $5) "
          "ORDER BY created_at DESC LIMIT $6")
# $1 now; as written, so that the partial index journal_quarantined serves it
COUNT_QUARANTINED = "SELECT count(*) FROM journal WHERE state = 'unknown' AND expires_at > $1"
# the kid index's range: "g" sorts after every hex digit (kids and prefixes are lowercase hex); $4 now
KIDS = "SELECT kid FROM journal WHERE kid >= $1 AND kid < $2 AND expires_at > $4 ORDER BY kid LIMIT $3"
# Heartbeats that arrived together (the runs API's): arrays of the same length, $1 namespaces,
# $2 run ids, $3 epochs (NULL: unfenced), $4 times. A beat counts where its epoch is not
# superseded (checked on the row as locked); a run beaten twice keeps the later time. The
# rows are locked in byte order, as claims and the traffic's beats take them, so two
# proxies' batches never deadlock.
HEARTBEAT_MANY = f"""
WITH passed AS (
    SELECT r.tenant, r.run_id, b.at
    FROM runs r JOIN unnest($1::text[], $2::text[], $3::bigint[], $4::float8[]) AS b(tenant, run_id, epoch, at)
      USING (tenant, run_id)
    WHERE b.epoch IS NULL OR r.epoch <= b.epoch
    ORDER BY r.tenant COLLATE "C", r.run_id COLLATE "C" FOR UPDATE OF r)
UPDATE runs r SET last_seen = greatest(r.last_seen, m.at),
    state = CASE WHEN r.state = '{RunState.RESTARTING}' THEN '{RunState.RUNNING}' ELSE r.state END
FROM (SELECT tenant, run_id, max(at) AS at FROM passed GROUP BY tenant, run_id) m
WHERE r.tenant = m.tenant AND r.run_id = m.run_id
RETURNING {", ".join("r." + column for column in RUN_COLUMNS.split(", "))}"""
# $1 namespaces, $2 run ids (arrays of the same length): the runs as they are
GET_RUNS = f"""
SELECT {RUN_COLUMNS} FROM runs
WHERE (tenant, run_id) IN (SELECT * FROM unnest($1::text[], $2::text[]))"""
GET_RUN = f"SELECT {RUN_COLUMNS} FROM runs WHERE run_id = $2 AND ($1::text IS NULL OR tenant = $1)"
LIST_RUNS = (f"SELECT {RUN_COLUMNS} FROM runs WHERE $1::text IS NULL OR state = $1 "
             "ORDER BY created_at DESC LIMIT $2")
RUN_EPOCH = "SELECT epoch FROM runs WHERE tenant = $1 AND run_id = $2"
LOCK_RUN = f"SELECT {RUN_COLUMNS} FROM runs WHERE tenant = $1 AND run_id = $2 FOR UPDATE"
END_RUN = "UPDATE runs SET state = $1, ended_at = $2, history = $3 WHERE tenant = $4 AND run_id = $5"
REVIVE_RUN = ("UPDATE runs SET epoch = $1, restarts = $2, state = $3, started_at = $4, last_seen = $4, "
              "history = $5, restart_times = $6, ended_at = NULL, next_restart_at = 0 "
              "WHERE tenant = $7 AND run_id = $8")
NEW_ATTEMPT = ("UPDATE runs SET epoch = $1, restarts = $2, state = $3, started_at = $4, last_seen = $4, "
               "history = $5, restart_times = $6, claimed_until = 0 WHERE tenant = $7 AND run_id = $8")
# $1 now, $2 limit: the runs due, soonest due first. The index on due_at (migration 8) finds
# them; the exact condition (silent for longer than timeout_s, not "as long") is then
# checked on those rows only. An ended run's due_at is NULL, so no condition names the
# state: one would let the planner, before statistics exist, read every running run by
# runs_by_state and sort them.
_DUE = ("due_at <= $1 AND ((last_seen + timeout_s < $1 AND started_at + grace_s < $1) "
        "OR (lost_epoch = epoch AND hook IS NOT NULL)) "
        "AND next_restart_at <= $1")
SILENT_RUNS = f"SELECT {RUN_COLUMNS} FROM runs WHERE {_DUE} ORDER BY due_at LIMIT $2"
# $1 now, $2 limit, $3 claimed until: SILENT_RUNS, each claimed by this caller until $3 (which
# moves its due_at there). Rows another supervisor is claiming are skipped, not waited for:
# replicas ticking together share the runs due instead of each reading all of them.
CLAIM_SILENT_RUNS = f"""
WITH due AS (SELECT tenant AS t, run_id AS r FROM runs WHERE {_DUE} ORDER BY due_at LIMIT $2
             FOR UPDATE SKIP LOCKED)
UPDATE runs SET claimed_until = $3 FROM due WHERE tenant = due.t AND run_id = due.r
RETURNING {RUN_COLUMNS}"""
COUNT_RUNS = "SELECT state, count(*) FROM runs GROUP BY state"
LIVE_RUNS = (f"SELECT count(*) FROM (SELECT 1 FROM runs WHERE tenant = $1 AND state IN "
             f"('{RunState.RUNNING}', '{RunState.RESTARTING}') LIMIT $2) AS live")
# $1 before, $2 batch, $3 every state (so runs_by_state (state, last_seen) finds them).
# Rows a writer holds are skipped, not waited for, as the journal's purge does.
PURGE_RUNS = """
WITH doomed AS (SELECT tenant, run_id FROM runs WHERE state = ANY($3::text[]) AND last_seen < $1
                AND coalesce(ended_at, 0) < $1 LIMIT $2 FOR UPDATE SKIP LOCKED),
gone AS (DELETE FROM runs r USING doomed d WHERE r.tenant = d.tenant AND r.run_id = d.run_id RETURNING 1)
SELECT count(*) FROM gone"""
# $1 namespace, $2 run_id, $3 epoch: one more held connection of a live, not lost attempt
ATTACH = (f"UPDATE runs SET attachments = attachments + 1 WHERE tenant = $1 AND run_id = $2 AND epoch = $3 "
          f"AND state IN ('{RunState.RUNNING}', '{RunState.RESTARTING}') AND lost_epoch IS DISTINCT FROM epoch")
# $1 epoch, $2 history, $3 namespace, $4 run_id, $5 channel: told at commit, to every supervisor
LOSE = (f"UPDATE runs SET lost_epoch = $1, history = $2 WHERE tenant = $3 AND run_id = $4 "
        f"RETURNING pg_notify($5, '{RUN_LOST}')")
