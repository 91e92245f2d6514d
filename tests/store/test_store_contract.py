"""The store contract: one suite, run on every backend (sqlite, postgres, redis).

Each test gets a fresh, empty store from the ``store_url`` fixture and talks to it only
through the :class:`Store` protocol, so a new backend passes by behaving, not by shape.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from idemproxy.proxy.config import StoreSettings
from idemproxy.proxy.store import Store, make_store
from idemproxy.proxy.store.administration import Audit
from idemproxy.proxy.store.composed import Connection, Journal, RunRegistry
from idemproxy.proxy.store.model import Claim, EntryState, Recorded, Run, RunState, Scope

TENANT = "tenant-a"  # whose credential made the call
NS = "ns-a"  # whose runs these are: a run's journal spans its tenants
REPLY = Recorded(201, [("content-type", "application/json"), ("x-request-id", "r1")],
                 b'{"id": "ch_1"}\n\x00\xff', streamed=True,
                 timing=[(0, 0.0), (10, 0.25)])


@pytest.fixture
def store_settings(store_url) -> StoreSettings:
    # PostgreSQL's journal in one-second partitions: the purges below drop whole ones
    return StoreSettings(url=store_url, partition_interval=1.0)


@pytest.fixture
async def open_store(store_settings):
    """Factory: another instance on the same store (as a second proxy replica would be)."""
    opened: list[Store] = []

    async def make() -> Store:
        store = make_store(store_settings)
        await store.open()
        opened.append(store)
        return store

    yield make
    for store in opened:
        await store.aclose()


@pytest.fixture
async def store(open_store) -> Store:
    return await open_store()


def scope(key: str = "step-1", run: str | None = "run-1", tenant: str = TENANT) -> Scope:
    return Scope(tenant, run, "tools", key)


def claim_of(sc: Scope, owner: str = "owner-1", fingerprint: str = "fp-1", lease_s: float = 30.0,
             retention_s: float = 3600.0, epoch: int | None = None, on_expired: str = "retry",
             namespace: str = NS) -> Claim:
    return Claim(sc, fingerprint, owner, lease_s, retention_s, "POST", "/charge", epoch, on_expired,
                 namespace)


def new_run(run_id: str = "run-1", tenant: str = NS, **fields) -> Run:
    now = time.time()
    values = dict(last_seen=now, started_at=now, created_at=now, timeout_s=60.0, grace_s=30.0,
                  max_restarts=5, hook="agent", metadata={"team": "billing"})
    return Run(tenant, run_id, **{**values, **fields})


async def claimed(store: Store, sc: Scope, **kw) -> str:
    result = await store.journal.claim(claim_of(sc, **kw))
    assert result.won
    return result.entry.owner


# -- basics --------------------------------------------------------------------------------

async def test_store_follows_the_protocol(store):
    assert isinstance(store, Store)
    # each part has both halves of its protocol: the hot path and the administration
    assert isinstance(store.journal, Journal) and isinstance(store.runs, RunRegistry)
    assert isinstance(store.audit, Audit) and isinstance(store.connection, Connection)
    assert isinstance(store.durability, str) and store.durability
    await store.ping()


async def test_secret_is_set_once_and_shared(store, open_store):
    assert await store.secret("tenant-hmac", b"first") == b"first"
    assert await store.secret("tenant-hmac", b"second") == b"first"
    other = await open_store()
    assert await other.secret("tenant-hmac", b"third") == b"first"
    assert await other.secret("another", b"\x00\xff") == b"\x00\xff"


# -- claims --------------------------------------------------------------------------------

async def test_first_claim_wins_and_the_next_one_sees_it(store):
    sc = scope()
    first = await store.journal.claim(claim_of(sc, owner="a"))
    assert first.won and first.stale_epoch is None
    assert (first.entry.kid, first.entry.state, first.entry.owner) == (sc.kid, EntryState.IN_FLIGHT, "a")
    assert first.entry.lease_until > time.time() + 20
    second = await store.journal.claim(claim_of(sc, owner="b"))
    assert not second.won
    assert (second.entry.owner, second.entry.fingerprint, second.entry.state) == ("a", "fp-1", EntryState.IN_FLIGHT)
    entry = await store.journal.get(sc.kid)
    assert (entry.tenant, entry.run, entry.upstream, entry.key) == (TENANT, "run-1", "tools", "step-1")
    assert (entry.method, entry.path, entry.namespace, entry.response) == ("POST", "/charge", NS, None)


async def test_a_claims_times_are_kept_to_the_bit(store):
    """What a claim answers with is what the store keeps: the times read back equal, not
    merely close (Redis writes a float as text, and must write every digit of it)."""
    sc = scope()
    first = await store.journal.claim(claim_of(sc))
    kept = await store.journal.get(sc.kid)
    said = first.entry
    assert (kept.created_at, kept.lease_until, kept.expires_at) == (said.created_at, said.lease_until,
                                                                     said.expires_at)
    assert said.lease_until == said.created_at + 30.0 and said.expires_at == said.created_at + 3600.0
    before = time.time()
    await store.journal.complete(sc.kid, first.entry.owner, REPLY)
    done = await store.journal.get(sc.kid)
    assert before <= done.completed_at <= time.time()
    assert (done.created_at, done.expires_at) == (said.created_at, said.expires_at)


async def test_a_lost_claim_carries_the_record_to_replay(store):
    sc = scope()
    owner = await claimed(store, sc)
    await store.journal.complete(sc.kid, owner, REPLY)
    lost = await store.journal.claim(claim_of(sc, owner="b"))
    assert not lost.won and lost.entry.state == EntryState.COMPLETE
    assert (lost.entry.response.status, lost.entry.response.body) == (REPLY.status, REPLY.body)


async def test_a_claim_with_another_fingerprint_keeps_the_first(store):
    sc = scope()
    await claimed(store, sc, fingerprint="fp-1")
    other = await store.journal.claim(claim_of(sc, owner="b", fingerprint="fp-2"))
    assert not other.won and other.entry.fingerprint == "fp-1"
    assert (await store.journal.get(sc.kid)).fingerprint == "fp-1"


async def test_tenants_and_runs_never_share_an_entry(store):
    for sc in (scope(tenant="t1"), scope(tenant="t2"), scope(run=None), scope(run="run-2")):
        assert (await store.journal.claim(claim_of(sc))).won


async def test_concurrent_claims_across_instances_have_one_winner(store, open_store):
    other = await open_store()
    sc = scope("hot-key")
    results = await asyncio.gather(*(s.journal.claim(claim_of(sc, owner=f"o{i}"))
                                     for i, s in enumerate([store, other] * 10)))
    winners = [r for r in results if r.won]
    assert len(winners) == 1
    assert all(r.entry.owner == winners[0].entry.owner for r in results)


async def test_claims_arriving_together_each_get_their_own_answer(store):
    """What one batch of claims can hold: new keys, one key twice, a key taken already,
    a fenced attempt and an expired lease to take over, each answered as if alone."""
    await store.runs.upsert(new_run(epoch=2))
    await claimed(store, scope("taken"), owner="first")
    await claimed(store, scope("lapsed"), owner="dead", lease_s=0.01)
    await asyncio.sleep(0.05)
    asks = [claim_of(scope(f"new-{i}"), owner=f"n{i}") for i in range(5)]
    asks += [claim_of(scope("twice"), owner="t1"), claim_of(scope("twice"), owner="t2"),
             claim_of(scope("taken"), owner="late"), claim_of(scope("stale"), owner="z", epoch=1),
             claim_of(scope("current"), owner="c", epoch=2), claim_of(scope("lapsed"), owner="heir")]
    results = await asyncio.gather(*(store.journal.claim(ask) for ask in asks))
    by_owner = dict(zip((ask.owner for ask in asks), results))
    assert all(by_owner[f"n{i}"].won for i in range(5))
    assert sorted((by_owner["t1"].won, by_owner["t2"].won)) == [False, True]
    assert by_owner["t1"].entry.owner == by_owner["t2"].entry.owner
    assert (by_owner["late"].won, by_owner["late"].entry.owner) == (False, "first")
    assert (by_owner["z"].won, by_owner["z"].stale_epoch) == (False, 2)
    assert await store.journal.get(scope("stale").kid) is None
    assert by_owner["c"].won and by_owner["heir"].won
    assert (await store.journal.get(scope("lapsed").kid)).owner == "heir"


async def test_live_lease_is_not_taken_over(store):
    sc = scope()
    await claimed(store, sc, owner="a", lease_s=30)
    assert not (await store.journal.claim(claim_of(sc, owner="b", on_expired="retry"))).won


async def test_expired_lease_is_taken_over_under_retry(store):
    sc = scope()
    await claimed(store, sc, owner="dead", lease_s=0.05)
    await asyncio.sleep(0.15)
    takeover = await store.journal.claim(claim_of(sc, owner="b", on_expired="retry"))
    assert takeover.won and takeover.entry.owner == "b"
    assert not await store.journal.complete(sc.kid, "dead", REPLY)  # the dead proxy's record is refused
    assert await store.journal.complete(sc.kid, "b", REPLY)


async def test_a_takeover_drops_the_partials_of_the_dead_call(store):
    sc = scope()
    await claimed(store, sc, owner="dead", lease_s=0.05)
    await store.journal.append_partial(sc.kid, "dead", 0, b'{"status": 200}')
    await store.journal.append_partial(sc.kid, "dead", 1, b"data: half")
    await asyncio.sleep(0.15)
    assert (await store.journal.claim(claim_of(sc, owner="b"))).won
    assert await store.journal.read_partial(sc.kid, -1) == []  # nobody joins the dead call's bytes


async def test_a_stream_quarantined_then_resolved_away_leaves_no_bytes_to_the_next_claim(store):
    """A streamed call's proxy died mid-stream; the retry quarantined its key; the operator
    resolved it as never sent. The next claim of the key must not be joined to the dead bytes."""
    sc = scope()
    await claimed(store, sc, owner="dead", lease_s=0.05)
    await store.journal.append_partial(sc.kid, "dead", 0, b'{"status": 200}')
    await store.journal.append_partial(sc.kid, "dead", 1, b"data: half")
    await asyncio.sleep(0.15)
    assert not (await store.journal.claim(claim_of(sc, owner="b", on_expired="quarantine"))).won
    assert await store.journal.resolve(sc.kid, None)
    assert (await store.journal.claim(claim_of(sc, owner="c"))).won
    assert await store.journal.read_partial(sc.kid, -1) == []


async def test_expired_lease_with_another_fingerprint_is_not_taken_over(store):
    sc = scope()
    await claimed(store, sc, owner="dead", lease_s=0.05, fingerprint="fp-1")
    await asyncio.sleep(0.15)
    other = await store.journal.claim(claim_of(sc, owner="b", fingerprint="fp-2"))
    assert not other.won and other.entry.owner == "dead"


async def test_expired_lease_is_quarantined_under_quarantine(store):
    sc = scope()
    await claimed(store, sc, owner="dead", lease_s=0.05)
    await asyncio.sleep(0.15)
    result = await store.journal.claim(claim_of(sc, owner="b", on_expired="quarantine"))
    assert not result.won
    assert (result.entry.state, result.entry.owner) == (EntryState.UNKNOWN, None)
    entry = await store.journal.get(sc.kid)
    assert entry.state == EntryState.UNKNOWN and entry.detail
    assert not await store.journal.complete(sc.kid, "dead", REPLY)
    assert not (await store.journal.claim(claim_of(sc, owner="c", on_expired="retry"))).won


async def test_claim_with_a_stale_epoch_is_refused(store):
    await store.runs.upsert(new_run(epoch=3))
    stale = await store.journal.claim(claim_of(scope("a"), epoch=2))
    assert (stale.won, stale.entry, stale.stale_epoch) == (False, None, 3)
    assert await store.journal.get(scope("a").kid) is None
    assert (await store.journal.claim(claim_of(scope("a"), epoch=3))).won
    assert (await store.journal.claim(claim_of(scope("b"), epoch=None))).won  # no epoch: not fenced
    assert (await store.journal.claim(claim_of(scope("c", run="other-run"), epoch=0))).won  # unknown run
    assert (await store.journal.claim(claim_of(scope("d"), epoch=0, namespace="ns-b"))).won  # another namespace's


async def test_claim_is_fenced_by_a_new_attempt(store):
    await store.runs.observe_epoch(NS, "run-1", 0, new_run(), time.time())
    assert await store.runs.new_attempt(NS, "run-1", 0, time.time(), "restart", True)
    assert (await store.journal.claim(claim_of(scope(), epoch=0))).stale_epoch == 1


# -- outcomes ------------------------------------------------------------------------------

async def test_only_the_owner_completes_and_the_record_reads_back(store):
    sc = scope()
    await claimed(store, sc, owner="a")
    assert not await store.journal.complete(sc.kid, "b", REPLY)
    assert (await store.journal.get(sc.kid)).state == EntryState.IN_FLIGHT
    assert await store.journal.complete(sc.kid, "a", REPLY)
    entry = await store.journal.get(sc.kid)
    assert (entry.state, entry.owner) == (EntryState.COMPLETE, None)
    assert entry.completed_at and entry.completed_at >= entry.created_at
    r = entry.response
    assert (r.status, r.headers, r.body, r.streamed, r.timing) == (
        REPLY.status, REPLY.headers, REPLY.body, True, REPLY.timing)
    assert not await store.journal.complete(sc.kid, "a", REPLY)  # once only


async def test_an_empty_body_reads_back_empty(store):
    sc = scope()
    owner = await claimed(store, sc)
    assert await store.journal.complete(sc.kid, owner, Recorded(204, [], b""))
    r = (await store.journal.get(sc.kid)).response
    assert (r.status, r.headers, r.body, r.streamed, r.timing) == (204, [], b"", False, [])


async def test_concurrent_completes_all_record(store):
    scopes = [scope(f"k{i}") for i in range(30)]
    for sc in scopes:
        await claimed(store, sc, owner=f"o-{sc.key}")
    kept = await asyncio.gather(*(store.journal.complete(sc.kid, f"o-{sc.key}", Recorded(200, [], sc.key.encode()))
                                  for sc in scopes))
    assert kept == [True] * 30
    for sc in scopes:
        assert (await store.journal.get(sc.kid)).response.body == sc.key.encode()


async def test_renew_extends_only_the_owners_live_claim(store):
    sc = scope()
    await claimed(store, sc, owner="a", lease_s=1)
    before = (await store.journal.get(sc.kid)).lease_until
    assert await store.journal.renew(sc.kid, "a", 60)
    assert (await store.journal.get(sc.kid)).lease_until > before + 30
    assert not await store.journal.renew(sc.kid, "b", 60)
    await store.journal.complete(sc.kid, "a", REPLY)
    assert not await store.journal.renew(sc.kid, "a", 60)


async def test_release_frees_the_key(store):
    sc = scope()
    await claimed(store, sc, owner="a")
    await store.journal.release(sc.kid, "b")  # not the owner: nothing happens
    assert (await store.journal.get(sc.kid)).owner == "a"
    await store.journal.release(sc.kid, "a")
    assert await store.journal.get(sc.kid) is None
    assert (await store.journal.claim(claim_of(sc, owner="c"))).won


async def test_occurrences_count_per_run_epoch_and_fingerprint(store):
    n = [await store.journal.next_occurrence(NS, "run-1", 0, "fp", 3600, tenant=TENANT) for _ in range(3)]
    assert n == [0, 1, 2]
    assert await store.journal.next_occurrence(NS, "run-1", 1, "fp", 3600, tenant=TENANT) == 0  # a new attempt
    assert await store.journal.next_occurrence(NS, "run-1", None, "fp", 3600, tenant=TENANT) == 0
    assert await store.journal.next_occurrence(NS, "run-1", 0, "other", 3600, tenant=TENANT) == 0
    assert await store.journal.next_occurrence("ns-b", "run-1", 0, "fp", 3600, tenant=TENANT) == 0
    # another credential's calls alike in the same run (a shared namespace) are its own count
    assert await store.journal.next_occurrence(NS, "run-1", 0, "fp", 3600, tenant="tenant-b") == 0
    assert await store.journal.next_occurrence(NS, "run-1", 0, "fp", 3600, tenant=TENANT) == 3


async def test_release_gives_back_a_derived_occurrence(store):
    assert await store.journal.next_occurrence(NS, "run-1", 0, "fp", 3600, tenant=TENANT) == 0
    assert await store.journal.next_occurrence(NS, "run-1", 0, "fp", 3600, tenant=TENANT) == 1
    sc = scope("derived:fp:1")
    await claimed(store, sc, owner="a", fingerprint="fp", epoch=0)
    await store.journal.release(sc.kid, "a")
    # the retry of the released call maps onto the same slot
    assert await store.journal.next_occurrence(NS, "run-1", 0, "fp", 3600, tenant=TENANT) == 1
    # releasing an older slot gives nothing back: later calls already hold higher numbers
    sc0 = scope("derived:fp:0")
    await claimed(store, sc0, owner="a", fingerprint="fp", epoch=0)
    await store.journal.release(sc0.kid, "a")
    assert await store.journal.next_occurrence(NS, "run-1", 0, "fp", 3600, tenant=TENANT) == 2


async def test_replay_occurrence_counts_on_with_next_occurrence_while_the_run_is_at_the_epoch(store):
    for epoch in (1, 2):  # a request raises a run's epoch by one at most
        await store.runs.observe_epoch(NS, "run-1", epoch, new_run(), time.time())
    assert await store.journal.next_occurrence(NS, "run-1", 2, "fp", 3600, tenant=TENANT) == 0
    assert await store.journal.replay_occurrence(NS, "run-1", 2, "fp", 3600, tenant=TENANT) == 1
    assert await store.journal.replay_occurrence(NS, "run-1", 2, "other", 3600, tenant=TENANT) == 0
    assert await store.journal.next_occurrence(NS, "run-1", 2, "fp", 3600, tenant=TENANT) == 2  # one counter
    # per tenant, as next_occurrence counts: another credential's calls alike start at 0
    assert await store.journal.replay_occurrence(NS, "run-1", 2, "fp", 3600, tenant="tenant-b") == 0
    assert await store.journal.next_occurrence(NS, "run-1", 2, "fp", 3600, tenant="tenant-b") == 1
    # fenced: a superseded or unknown attempt counts nothing
    await store.runs.new_attempt(NS, "run-1", 2, time.time(), "restart", restart=True)
    assert await store.journal.replay_occurrence(NS, "run-1", 2, "fp", 3600, tenant=TENANT) is None
    assert await store.journal.replay_occurrence(NS, "run-1", 4, "fp", 3600, tenant=TENANT) is None
    assert await store.journal.replay_occurrence(NS, "no-such-run", 0, "fp", 3600, tenant=TENANT) is None
    assert await store.journal.next_occurrence(NS, "run-1", 2, "fp", 3600, tenant=TENANT) == 3
    assert await store.journal.replay_occurrence(NS, "run-1", 3, "fp", 3600, tenant=TENANT) == 0


async def test_recorded_loads_a_runs_complete_entries_with_their_answers(store):
    first, second = scope("s1"), scope("s2", tenant="tenant-b")  # same run, another credential
    for sc in (first, second):
        owner = await claimed(store, sc)
        await store.journal.complete(sc.kid, owner, REPLY)
        await asyncio.sleep(0.01)
    await claimed(store, scope("in-flight"))  # not recorded (yet): left out
    quarantined = scope("unknown")
    owner = await claimed(store, quarantined)
    await store.journal.quarantine(quarantined.kid, owner, "ambiguous")
    expired = scope("expired")
    owner = await claimed(store, expired, retention_s=0.2)
    await store.journal.complete(expired.kid, owner, REPLY)
    other = scope("s1", run="run-2")
    owner = await claimed(store, other)
    await store.journal.complete(other.kid, owner, REPLY)
    await asyncio.sleep(0.3)

    entries, complete = await store.journal.recorded(NS, "run-1", 1 << 20)
    assert complete and list(entries) == [first.kid, second.kid]  # oldest first
    entry = entries[first.kid]
    assert (entry.key, entry.tenant, entry.state, entry.fingerprint) == ("s1", TENANT, EntryState.COMPLETE, "fp-1")
    assert entry.response == REPLY  # the whole answer, streamed with its timing
    assert await store.journal.recorded("ns-b", "run-1", 1 << 20) == ({}, True)
    # bounded: the oldest entries whose bodies fit, and a sign that there is more
    one_body = len(REPLY.body)
    assert await store.journal.recorded(NS, "run-1", 2 * one_body) == (entries, True)
    partial, complete = await store.journal.recorded(NS, "run-1", 2 * one_body - 1)
    assert (list(partial), complete) == ([first.kid], False)
    assert await store.journal.recorded(NS, "run-1", 0) == ({}, False)


async def test_quarantine_then_resolve_as_retry(store):
    sc = scope()
    await claimed(store, sc, owner="a")
    await store.journal.quarantine(sc.kid, "b", "not the owner")
    assert (await store.journal.get(sc.kid)).state == EntryState.IN_FLIGHT
    await store.journal.quarantine(sc.kid, "a", "upstream answered 502")
    entry = await store.journal.get(sc.kid)
    assert (entry.state, entry.owner, entry.detail) == (EntryState.UNKNOWN, None, "upstream answered 502")
    assert not (await store.journal.claim(claim_of(sc, owner="c"))).won
    assert await store.journal.resolve(sc.kid, None)
    # kept and findable, as retried; resolved once only
    entry = await store.journal.get(sc.kid)
    assert (entry.state, entry.detail) == (EntryState.RETRIED, "upstream answered 502")
    assert [e.kid for e in await store.journal.search(state=EntryState.RETRIED)] == [sc.kid]
    assert [e.state for e in await store.journal.entries(NS, "run-1")] == [EntryState.RETRIED]
    assert not await store.journal.resolve(sc.kid, None)
    # the next call goes upstream, whatever its fingerprint; it is an entry like any other then
    taken = await store.journal.claim(claim_of(sc, owner="c", fingerprint="fp-2"))
    assert taken.won
    assert (await store.journal.get(sc.kid)).state == EntryState.IN_FLIGHT
    assert not (await store.journal.claim(claim_of(sc, owner="d", fingerprint="fp-2"))).won


async def test_a_retried_entry_is_taken_over_under_quarantine_too(store):
    """The retry rule holds for claims that quarantine an expired lease: the entry is the
    operator's retry, not a dead proxy's claim."""
    sc = scope()
    await claimed(store, sc, owner="a", on_expired="quarantine")
    await store.journal.quarantine(sc.kid, "a", "upstream answered 502")
    assert await store.journal.resolve(sc.kid, None)
    assert (await store.journal.claim(claim_of(sc, owner="b", on_expired="quarantine"))).won
    assert await store.journal.complete(sc.kid, "b", REPLY)
    assert (await store.journal.get(sc.kid)).state == EntryState.COMPLETE


EVIDENCE = {"request": {"headers": [["content-type", "application/json"], ["authorization", "***"]],
                        "body_base64": "eyJhbW91bnQiOiA0Mn0=", "bytes": 14, "truncated": False},
            "answer": {"status": 502, "headers": [["content-type", "text/plain"]],
                       "body_base64": "YmFkIGdhdGV3YXk=", "bytes": 11, "truncated": False}}


async def test_quarantine_keeps_its_evidence_until_the_next_claim(store):
    sc = scope()
    await claimed(store, sc, owner="a")
    assert (await store.journal.get(sc.kid)).evidence is None
    await store.journal.quarantine(sc.kid, "a", "upstream answered 502", EVIDENCE)
    assert (await store.journal.get(sc.kid)).evidence == EVIDENCE
    assert await store.journal.resolve(sc.kid, None)
    assert (await store.journal.get(sc.kid)).evidence == EVIDENCE  # what the decision was made on
    assert (await store.journal.claim(claim_of(sc, owner="b"))).won
    assert (await store.journal.get(sc.kid)).evidence is None  # a new call: its own outcome


async def test_quarantined_entries_are_counted(store):
    assert await store.journal.count_quarantined() == 0
    kids = []
    for key in ("a", "b", "c"):
        sc = scope(key)
        await claimed(store, sc, owner="o")
        await store.journal.quarantine(sc.kid, "o", "upstream answered 502")
        kids.append(sc.kid)
    gone = scope("gone")
    await claimed(store, gone, owner="o", retention_s=0.2)
    await store.journal.quarantine(gone.kid, "o", "upstream answered 502")
    assert await store.journal.count_quarantined() == 4
    await asyncio.sleep(0.3)  # one expired: not counted, before any purge
    assert await store.journal.count_quarantined() == 3
    assert await store.journal.resolve(kids[0], None)
    assert await store.journal.resolve(kids[1], Recorded(200, [], b"sent"))
    assert await store.journal.count_quarantined() == 1
    other = scope("x", run="run-2")
    await claimed(store, other, owner="o")
    await store.journal.quarantine(other.kid, "o", "timeout")
    await store.journal.delete_run(NS, "run-2")
    assert await store.journal.count_quarantined() == 1
    await store.journal.purge(time.time())
    assert await store.journal.count_quarantined() == 1


async def test_operator_actions_are_kept_by_entry_and_by_run(store, open_store):
    from idemproxy.proxy.store.model import Action
    now = time.time()
    retry = Action(now, "admin:alice", "resolve-retry", NS, "run-1", "k" * 64, {"status": None})
    revive = Action(now + 1, "console:alice", "revive", NS, "run-1", None, {"epoch": 2})
    elsewhere = Action(now + 2, "cli:bob@host", "delete-journal", "ns-b", "run-1", None, {"deleted": 3})
    for action in (retry, revive, elsewhere):
        await store.audit.note(action, 3600.0)
    other = await open_store()  # another replica sees them
    assert await other.audit.of_entry("k" * 64) == [retry]
    assert await other.audit.of_run(NS, "run-1") == [retry, revive]
    assert await other.audit.of_run("ns-b", "run-1") == [elsewhere]
    assert await other.audit.of_entry("j" * 64) == []
    short = Action(time.time(), "admin:alice", "restart", NS, "run-9", None, {})
    await store.audit.note(short, 0.2)
    await asyncio.sleep(0.3)
    assert await store.audit.of_run(NS, "run-9") == []  # kept for its retention only
    await store.audit.purge(time.time())
    assert await store.audit.of_run(NS, "run-1") == [retry, revive]


async def test_resolve_with_a_response_to_replay(store):
    sc = scope()
    await claimed(store, sc, owner="a")
    assert not await store.journal.resolve(sc.kid, REPLY)  # only unknown keys are resolved
    await store.journal.quarantine(sc.kid, None, "operator says: unknown")
    assert await store.journal.resolve(sc.kid, Recorded(200, [("content-type", "text/plain")], b"sent"))
    entry = await store.journal.get(sc.kid)
    assert entry.state == EntryState.COMPLETE
    assert (entry.response.status, entry.response.body) == (200, b"sent")
    assert entry.response.headers == [("content-type", "text/plain")]


async def test_unrecordable(store):
    sc = scope()
    await claimed(store, sc, owner="a")
    await store.journal.mark_unrecordable(sc.kid, "a", "response over 100 bytes")
    entry = await store.journal.get(sc.kid)
    assert (entry.state, entry.detail, entry.owner) == (EntryState.UNRECORDABLE, "response over 100 bytes", None)
    assert not await store.journal.complete(sc.kid, "a", REPLY)


async def test_partials_are_kept_in_order_until_the_record(store):
    sc = scope()
    await claimed(store, sc, owner="a")
    assert await store.journal.read_partial(sc.kid, -1) == []
    await store.journal.append_partial(sc.kid, "a", 0, b'{"status": 200}')
    await store.journal.append_partial(sc.kid, "a", 1, b"data: one\n\n")
    await store.journal.append_partial(sc.kid, "a", 2, b"data: two\n\n")
    await store.journal.append_partial(sc.kid, "a", 1, b"a seq sent again is ignored")
    assert await store.journal.read_partial(sc.kid, -1) == [
        (0, b'{"status": 200}'), (1, b"data: one\n\n"), (2, b"data: two\n\n")]
    assert await store.journal.read_partial(sc.kid, 1) == [(2, b"data: two\n\n")]
    await store.journal.complete(sc.kid, "a", REPLY)
    assert await store.journal.read_partial(sc.kid, -1) == []


async def test_replays_are_counted(store):
    sc = scope()
    owner = await claimed(store, sc)
    await store.journal.complete(sc.kid, owner, REPLY)
    await store.journal.count_replays({sc.kid: 2})
    await store.journal.count_replays({sc.kid: 3, scope("no-such-key").kid: 1})
    assert (await store.journal.get(sc.kid)).replays == 5


async def test_replays_are_tallied_under_the_epoch_of_their_run(store):
    await store.runs.upsert(new_run("run-1"))
    sc, loose = scope(), scope("loose", run=None)
    for each in (sc, loose):
        owner = await claimed(store, each, epoch=0 if each.run else None)
        await store.journal.complete(each.kid, owner, REPLY)
    before = time.time()
    await store.journal.count_replays({sc.kid: 2, loose.kid: 1})  # the run is at epoch 0
    [entry] = await store.journal.entries(NS, "run-1")
    assert entry.replayed.keys() == {0} and entry.replayed[0][0] == 2
    first_seen = entry.replayed[0][1]
    assert before - 1 <= first_seen <= time.time() + 1
    await store.runs.new_attempt(NS, "run-1", 0, time.time(), "restart", True)
    await store.journal.count_replays({sc.kid: 1})
    await store.journal.count_replays({sc.kid: 1})
    [entry] = await store.journal.entries(NS, "run-1")
    assert (entry.replays, entry.replayed[0], entry.replayed[1][0]) == (4, (2, first_seen), 2)
    assert entry.replayed[1][1] >= first_seen
    [found] = await store.journal.search(key="loose")
    assert (found.replays, found.replayed) == (1, {})  # no run: counted, not tallied


async def test_search_filters_entries_newest_first(store):
    owner = await claimed(store, scope("key:a"))
    await store.journal.complete(scope("key:a").kid, owner, REPLY)
    await asyncio.sleep(0.01)
    await store.journal.quarantine(scope("key:b").kid, await claimed(store, scope("key:b")), "upstream 503")
    await asyncio.sleep(0.01)
    await claimed(store, scope("key:a", run=None, tenant="tenant-b"))
    await asyncio.sleep(0.01)
    await claimed(store, scope("key:a", run="run-2"))
    assert [(e.key, e.run, e.tenant) for e in await store.journal.search()] == [
        ("key:a", "run-2", TENANT), ("key:a", None, "tenant-b"), ("key:b", "run-1", TENANT),
        ("key:a", "run-1", TENANT)]
    [quarantined] = await store.journal.search(state=EntryState.UNKNOWN)
    assert (quarantined.key, quarantined.detail, quarantined.response) == ("key:b", "upstream 503", None)
    assert [e.run for e in await store.journal.search(key="key:a", tenant=TENANT)] == ["run-2", "run-1"]
    [only] = await store.journal.search(key="key:a", run="run-1")
    assert (only.state, only.response.status, only.response.body) == (EntryState.COMPLETE, REPLY.status, b"")
    assert len(await store.journal.search(limit=2)) == 2
    assert await store.journal.search(key="key:none") == []


# -- waiting -------------------------------------------------------------------------------

async def _complete(store, sc, owner):
    await store.journal.complete(sc.kid, owner, REPLY)


async def _release(store, sc, owner):
    await store.journal.release(sc.kid, owner)


async def _quarantine(store, sc, owner):
    await store.journal.quarantine(sc.kid, owner, "502")


async def _partial(store, sc, owner):
    await store.journal.append_partial(sc.kid, owner, 0, b"{}")


@pytest.mark.parametrize("change", [_complete, _release, _quarantine, _partial])
async def test_wait_wakes_when_the_entry_changes(store, open_store, change):
    writer = await open_store()  # as another replica: the waiter must hear of it through the store
    sc = scope()
    owner = await claimed(writer, sc)
    started = time.monotonic()
    waiter = asyncio.create_task(store.journal.wait(sc.kid, 10.0))
    await asyncio.sleep(0.05)
    changed = time.monotonic()
    await change(writer, sc, owner)
    await asyncio.wait_for(waiter, 5.0)
    assert time.monotonic() - changed < 0.3, "the waiter must wake soon after the change"
    assert time.monotonic() - started < 10.0


async def test_wait_returns_by_its_timeout_when_nothing_changes(store):
    started = time.monotonic()
    await store.journal.wait(scope().kid, 0.2)
    assert time.monotonic() - started < 1.0


# -- retention and the journal -------------------------------------------------------------

async def test_expired_entries_run_as_new_and_are_purged(store):
    old = [scope(f"old-{i}") for i in range(5)]
    for sc in old:
        owner = await claimed(store, sc, retention_s=0.2)
        await store.journal.complete(sc.kid, owner, REPLY)
    keep = scope("keep")
    await claimed(store, keep)
    await asyncio.sleep(0.4)
    assert await store.journal.get(old[0].kid) is None  # expired: gone for readers at once
    assert (await store.journal.claim(claim_of(old[0], owner="new"))).won  # and runs as new
    purged = await store.journal.purge(time.time(), batch=2)  # batches are small; one call does all
    # (at most 4 where old-0's row was taken over in place, 5 where its expired row stays
    # beside the new one until its range is dropped: PostgreSQL's partitioned journal)
    assert isinstance(purged, int) and purged <= 5
    listed = {e.key for e in await store.journal.entries(NS, "run-1")}
    assert listed == {"keep", "old-0"}
    assert (await store.journal.get(keep.kid)).state == EntryState.IN_FLIGHT


async def test_a_backlog_many_batches_long_is_purged_in_one_call(store):
    """A day's backlog after a stop: more expired entries than a batch holds, in and out of
    runs, with a stream's partial bytes; one purge takes them all, and nothing live."""
    expired = [scope(f"old-{i}", run=None if i % 3 else "run-1") for i in range(230)]
    await asyncio.gather(*(claimed(store, sc, retention_s=0.3) for sc in expired))
    await store.journal.append_partial(expired[1].kid, "owner-1", 0, b"half a stream")
    live = [scope(f"live-{i}") for i in range(3)]
    for sc in live:
        await claimed(store, sc)
    await asyncio.sleep(1.4)  # past the end of the (one-second) partition they expired in
    purged = await store.journal.purge(time.time(), batch=50)
    assert 0 < purged <= len(expired)  # Redis expires entries itself: it counts what indexed them
    assert await store.journal.purge(time.time()) == 0
    assert {e.key for e in await store.journal.entries(NS, "run-1")} == {sc.key for sc in live}
    assert await store.journal.read_partial(expired[1].kid, -1) == []
    assert all([(await store.journal.get(sc.kid)).state == EntryState.IN_FLIGHT for sc in live])


async def test_expired_occurrence_counters_are_purged(store):
    assert await store.journal.next_occurrence(NS, "run-1", 0, "fp", 0.2, tenant=TENANT) == 0
    assert await store.journal.next_occurrence(NS, "run-1", 0, "fp", 0.2, tenant=TENANT) == 1
    await asyncio.sleep(0.4)
    await store.journal.purge(time.time())
    assert await store.journal.next_occurrence(NS, "run-1", 0, "fp", 3600, tenant=TENANT) == 0


async def test_each_occurrence_extends_the_counters_retention(store):
    assert await store.journal.next_occurrence(NS, "run-1", 0, "fp", 0.4, tenant=TENANT) == 0
    await asyncio.sleep(0.25)
    assert await store.journal.next_occurrence(NS, "run-1", 0, "fp", 0.4, tenant=TENANT) == 1
    await asyncio.sleep(0.25)  # past the first call's retention, within the second's
    await store.journal.purge(time.time())
    assert await store.journal.next_occurrence(NS, "run-1", 0, "fp", 3600, tenant=TENANT) == 2


async def test_journal_lists_a_runs_entries_without_bodies(store):
    first, second = scope("s1"), scope("s2")
    owner = await claimed(store, first)
    await store.journal.complete(first.kid, owner, REPLY)
    await asyncio.sleep(0.01)
    await claimed(store, second)
    await asyncio.sleep(0.01)
    await claimed(store, scope("s3", tenant="tenant-b"))  # same run, another credential
    await claimed(store, scope("elsewhere", run="run-2"))
    await claimed(store, scope("s1", tenant="tenant-c"), namespace="ns-b")  # ns-b's run-1 is another run
    entries = await store.journal.entries(NS, "run-1")
    assert [(e.key, e.tenant) for e in entries] == [("s1", TENANT), ("s2", TENANT), ("s3", "tenant-b")]
    assert entries[0].state == EntryState.COMPLETE and entries[0].response.status == REPLY.status
    assert entries[0].response.body == b""  # metadata only
    assert entries[1].state == EntryState.IN_FLIGHT and entries[1].response is None
    assert [e.key for e in await store.journal.entries("ns-b", "run-1")] == ["s1"]


async def test_delete_journal_removes_only_that_run(store):
    await store.journal.next_occurrence(NS, "run-1", 0, "fp", 3600, tenant=TENANT)
    for key in ("s1", "s2"):
        await claimed(store, scope(key))
    await claimed(store, scope("s3", tenant="tenant-b"))
    await claimed(store, scope("s1", run="run-2"))
    await claimed(store, scope("s1", tenant="tenant-c"), namespace="ns-b")
    assert await store.journal.delete_run(NS, "run-1") == 3
    assert await store.journal.entries(NS, "run-1") == []
    assert await store.journal.get(scope("s1").kid) is None
    assert len(await store.journal.entries(NS, "run-2")) == 1
    assert len(await store.journal.entries("ns-b", "run-1")) == 1
    assert await store.journal.next_occurrence(NS, "run-1", 0, "fp", 3600, tenant=TENANT) == 0  # numbering starts over



async def test_generation_rises_with_every_journal_delete_and_nothing_else(store):
    # Entries held in a proxy's memory answer only under the generation they were read in
    # (proxy/freshness.py): a delete raises it; records, resolves and purges of expired
    # entries change no complete entry a proxy may hold, and leave it be.
    journal = store.journal
    assert await journal.generation() == 0
    sc = scope()
    await journal.complete(sc.kid, await claimed(store, sc), REPLY)
    quarantined = scope("s2")
    await claimed(store, quarantined, owner="a")
    await journal.quarantine(quarantined.kid, "a", "upstream answered 502")
    assert await journal.resolve(quarantined.kid, REPLY)
    await journal.purge(time.time() + 10 * 86400)
    assert await journal.generation() == 0
    assert await journal.delete_run(NS, "run-1") >= 0
    assert await journal.generation() == 1
    assert await journal.delete_run(NS, "no-such-run") == 0  # raised all the same: it is cheap
    assert await journal.generation() == 2

# -- runs ----------------------------------------------------------------------------------

async def test_upsert_get_and_list_runs(store):
    made = await store.runs.upsert(new_run("run-1"))
    assert (made.run_id, made.state, made.epoch, made.hook, made.metadata) == (
        "run-1", RunState.RUNNING, 0, "agent", {"team": "billing"})
    await store.runs.new_attempt(NS, "run-1", 0, time.time(), "restart", True)
    updated = await store.runs.upsert(new_run("run-1", timeout_s=5.0, grace_s=1.0, max_restarts=2,
                                             hook=None, metadata={"team": "ops", "n": [1, 2]}))
    assert (updated.timeout_s, updated.grace_s, updated.max_restarts, updated.hook) == (5.0, 1.0, 2, None)
    assert updated.metadata == {"team": "ops", "n": [1, 2]}
    assert (updated.epoch, updated.state) == (1, RunState.RESTARTING)  # upsert never resets the attempt
    await store.runs.upsert(new_run("run-1", tenant="ns-b"))
    await store.runs.upsert(new_run("run-2"))
    await store.runs.end(NS, "run-2", RunState.COMPLETED, time.time())
    assert [(r.namespace, r.epoch) for r in await store.runs.find(NS, "run-1")] == [(NS, 1)]
    assert {r.namespace for r in await store.runs.find(None, "run-1")} == {NS, "ns-b"}
    assert await store.runs.find(NS, "nope") == []
    assert {r.run_id for r in await store.runs.list(RunState.COMPLETED)} == {"run-2"}
    assert {(r.namespace, r.run_id) for r in await store.runs.list(RunState.RESTARTING)} == {(NS, "run-1")}
    assert len(await store.runs.list()) == 3
    assert len(await store.runs.list(limit=2)) == 2


async def test_observe_epoch_creates_raises_by_one_and_never_lowers(store):
    now = time.time()
    defaults = new_run("ignored", timeout_s=7.0, hook="agent")
    assert await store.runs.observe_epoch(NS, "run-1", None, defaults, now) == 0
    [run] = await store.runs.find(NS, "run-1")
    assert (run.state, run.epoch, run.timeout_s, run.hook) == (RunState.RUNNING, 0, 7.0, "agent")
    assert await store.runs.observe_epoch(NS, "run-1", 1, defaults, now + 1) == 1
    assert await store.runs.observe_epoch(NS, "run-1", 2, defaults, now + 2) == 2
    assert await store.runs.observe_epoch(NS, "run-1", 1, defaults, now + 3) == 2
    assert await store.runs.observe_epoch(NS, "run-1", None, defaults, now + 4) == 2
    [run] = await store.runs.find(NS, "run-1")
    assert run.epoch == 2 and run.started_at == pytest.approx(now + 2)
    assert await store.runs.observe_epoch(NS, "run-new", 1, defaults, now) == 1


async def test_observe_epoch_moves_no_run_further_than_the_next_epoch(store):
    now = time.time()
    assert await store.runs.observe_epoch(NS, "run-1", 0, new_run(), now) == 0
    for ahead in (2, 7, 999_999_999_999_999):
        assert await store.runs.observe_epoch(NS, "run-1", ahead, new_run(), now + 1) == 0
    [run] = await store.runs.find(NS, "run-1")
    assert (run.epoch, run.started_at) == (0, pytest.approx(now))
    # an unknown run counts as one at epoch 0: asked for more than 1, nothing is created
    assert await store.runs.observe_epoch(NS, "run-2", 5, new_run(), now) == 0
    assert await store.runs.find(NS, "run-2") == []


async def test_observe_epoch_concurrently_from_two_instances(store, open_store):
    other = await open_store()
    now = time.time()
    await store.runs.observe_epoch(NS, "run-1", 0, new_run(), now)
    asked = [(store, 1), (other, 1), (store, 0), (other, 1), (store, 1)]
    seen = await asyncio.gather(*(s.runs.observe_epoch(NS, "run-1", e, new_run(), now) for s, e in asked))
    # whichever order the race takes, the run moves to epoch 1 once and nobody is told less
    assert [got for got, (_, e) in zip(seen, asked) if e == 1] == [1, 1, 1, 1] and seen[2] in (0, 1)
    assert (await store.runs.find(NS, "run-1"))[0].epoch == 1


async def test_runs_neither_seen_nor_ended_for_a_retention_are_purged(store):
    now = time.time()
    for run_id in ("ended-long-ago", "ended-lately", "idle", "busy"):
        await store.runs.upsert(new_run(run_id, last_seen=now - 100))
    await store.runs.upsert(new_run("idle", tenant="ns-b", last_seen=now - 100))
    await store.runs.end(NS, "ended-long-ago", RunState.COMPLETED, now - 90)
    await store.runs.end(NS, "ended-lately", RunState.FAILED, now - 5)
    await store.runs.touch({(NS, "busy", None): now - 1})
    assert await store.runs.purge(now - 10, batch=2) == 3  # in batches, to the end
    assert {(r.namespace, r.run_id) for r in await store.runs.list()} == {(NS, "ended-lately"), (NS, "busy")}
    assert await store.runs.find(None, "idle") == [] and await store.runs.find(NS, "ended-long-ago") == []
    assert [r.run_id for r in await store.runs.silent(now + 1000)] == ["busy"]
    assert await store.runs.count() == {RunState.FAILED: 1, RunState.RUNNING: 1}
    assert await store.runs.purge(now - 10) == 0
    # a purged run's id is free: its next request starts it over
    assert await store.runs.observe_epoch(NS, "idle", 0, new_run(), now) == 0


async def test_touch_moves_last_seen_forward_only(store):
    await store.runs.upsert(new_run("run-1", last_seen=100.0))
    await store.runs.new_attempt(NS, "run-1", 0, 150.0, "restart", True)
    await store.runs.touch({(NS, "run-1", None): 200.0, (NS, "no-such-run", None): 200.0})
    [run] = await store.runs.find(NS, "run-1")
    assert (run.last_seen, run.state) == (200.0, RunState.RUNNING)  # traffic means the restart took
    await store.runs.touch({(NS, "run-1", None): 120.0})
    assert (await store.runs.find(NS, "run-1"))[0].last_seen == 200.0
    await store.runs.touch({})


async def test_touch_ignores_the_beats_of_a_superseded_attempt(store):
    """A call of epoch 0 still open after a restart keeps no one alive: only the
    current attempt's open requests keep its run alive."""
    await store.runs.upsert(new_run("run-1", last_seen=100.0))
    await store.runs.upsert(new_run("run-2", last_seen=100.0))
    await store.runs.new_attempt(NS, "run-1", 0, 150.0, "restart", True)
    await store.runs.touch({(NS, "run-1", 0): 300.0, (NS, "run-2", 0): 300.0})
    [run] = await store.runs.find(NS, "run-1")
    assert (run.last_seen, run.state) == (150.0, RunState.RESTARTING)
    assert (await store.runs.find(NS, "run-2"))[0].last_seen == 300.0
    await store.runs.touch({(NS, "run-1", 1): 200.0, (NS, "run-1", 0): 400.0, (NS, "run-1", 2): 250.0})
    [run] = await store.runs.find(NS, "run-1")
    assert (run.last_seen, run.state) == (250.0, RunState.RUNNING)  # its own epoch, or one about to start


async def test_end_run_once(store):
    await store.runs.upsert(new_run("run-1"))
    ended = await store.runs.end(NS, "run-1", RunState.COMPLETED, 500.0)
    assert (ended.state, ended.ended_at) == (RunState.COMPLETED, 500.0)
    assert ended.history[-1]["event"] == RunState.COMPLETED
    again = await store.runs.end(NS, "run-1", RunState.FAILED, 600.0)
    assert (again.state, again.ended_at) == (RunState.COMPLETED, 500.0)
    [run] = await store.runs.find(NS, "run-1")
    assert (run.state, run.ended_at, len(run.history)) == (RunState.COMPLETED, 500.0, 1)
    assert await store.runs.end(NS, "no-such-run", RunState.COMPLETED, 1.0) is None
    assert await store.runs.new_attempt(NS, "run-1", None, 700.0, "restart", True) is None


async def test_how_an_attempt_ended_is_kept_with_what_ended_it(store):
    """``ended`` is remembered in the same change as the new attempt or the end, for the
    attempt it ended (proxy/runs/endings.py); a caller that loses the compare-and-set, or
    ends an ended run, adds nothing."""
    await store.runs.upsert(new_run("run-1"))
    at = 1796416590.0816596  # all its digits come back, from every store
    tail = "Traceback (most recent call last):\n  \"quoted\" \\ \u00e9\nKeyError: 'amount'"
    crash = {"how": "exited", "detail": "exited with code 1", "code": 1, "signal": None, "log": "a.log",
             "log_tail": tail}
    run = await store.runs.new_attempt(NS, "run-1", 0, at, "restart", True, window_s=60, ended=crash)
    assert run.history == [{"at": at, "epoch": 0, "event": "ended", **crash},
                           {"at": at, "epoch": 1, "event": "restart"}]
    assert await store.runs.new_attempt(NS, "run-1", 0, at + 1, "restart", True, ended={"how": "silent"}) is None
    done = {"how": "completed", "detail": "completed by the agent", "by": "agent"}
    ended = await store.runs.end(NS, "run-1", RunState.COMPLETED, at + 2, ended=done)
    assert ended.history[-2:] == [{"at": at + 2, "epoch": 1, "event": "ended", **done},
                                  {"at": at + 2, "epoch": 1, "event": RunState.COMPLETED}]
    await store.runs.end(NS, "run-1", RunState.FAILED, at + 3, ended={"how": "failed"})
    [run] = await store.runs.find(NS, "run-1")
    assert [e["event"] for e in run.history] == ["ended", "restart", "ended", RunState.COMPLETED]
    assert run.history[0]["log_tail"] == tail and run.history[0]["at"] == at


async def test_new_attempt_is_a_compare_and_set(store):
    await store.runs.upsert(new_run("run-1"))
    first = await store.runs.new_attempt(NS, "run-1", 0, 100.0, "silent for 60s", True)
    assert (first.epoch, first.restarts, first.state, first.started_at, first.last_seen) == (
        1, 1, RunState.RESTARTING, 100.0, 100.0)
    assert first.history[-1] == {"at": 100.0, "epoch": 1, "event": "silent for 60s"}
    assert await store.runs.new_attempt(NS, "run-1", 0, 101.0, "late supervisor", True) is None
    manual = await store.runs.new_attempt(NS, "run-1", None, 102.0, "attempt", False)
    assert (manual.epoch, manual.restarts, manual.state) == (2, 1, RunState.RUNNING)
    [run] = await store.runs.find(NS, "run-1")
    assert (run.epoch, run.restarts, len(run.history)) == (2, 1, 2)
    assert await store.runs.new_attempt(NS, "no-such-run", None, 1.0, "x", True) is None


async def test_concurrent_new_attempts_have_one_winner(store, open_store):
    other = await open_store()
    await store.runs.upsert(new_run("run-1"))
    results = await asyncio.gather(*(s.runs.new_attempt(NS, "run-1", 0, time.time(), f"by {i}", True)
                                     for i, s in enumerate([store, other] * 4)))
    assert len([r for r in results if r is not None]) == 1
    [run] = await store.runs.find(NS, "run-1")
    assert (run.epoch, run.restarts) == (1, 1)


async def test_history_keeps_the_last_fifty_events(store):
    await store.runs.upsert(new_run("run-1"))
    for i in range(60):
        assert await store.runs.new_attempt(NS, "run-1", i, float(i), f"event {i}", False)
    [run] = await store.runs.find(NS, "run-1")
    assert len(run.history) == 50
    assert (run.history[0]["event"], run.history[-1]["event"]) == ("event 10", "event 59")


async def test_silent_runs_by_timeout_and_grace(store):
    now = time.time()
    await store.runs.upsert(new_run("silent", last_seen=now - 100, started_at=now - 100, timeout_s=60,
                                   grace_s=30))
    await store.runs.upsert(new_run("alive", last_seen=now - 10, started_at=now - 100, timeout_s=60))
    await store.runs.upsert(new_run("in-grace", last_seen=now - 100, started_at=now - 10, timeout_s=60,
                                   grace_s=30))
    await store.runs.upsert(new_run("ended", last_seen=now - 100, started_at=now - 100))
    await store.runs.end(NS, "ended", RunState.FAILED, now)
    await store.runs.upsert(new_run("backing-off", last_seen=now - 100, started_at=now - 100))
    await store.runs.set_state(NS, "backing-off", RunState.RUNNING, now, next_restart_at=now + 30)
    assert {r.run_id for r in await store.runs.silent(now)} == {"silent"}
    assert {r.run_id for r in await store.runs.silent(now + 31)} == {"silent", "in-grace", "backing-off"}


async def test_set_run_state(store):
    await store.runs.upsert(new_run("run-1"))
    await store.runs.set_state(NS, "run-1", RunState.DEAD, 300.0, event={"event": "dead", "restarts": 6},
                              ended_at=300.0, restarts=6)
    [run] = await store.runs.find(NS, "run-1")
    assert (run.state, run.ended_at, run.restarts) == (RunState.DEAD, 300.0, 6)
    assert run.history[-1] == {"at": 300.0, "event": "dead", "restarts": 6}
    await store.runs.set_state(NS, "run-1", RunState.DEAD, 301.0)  # no event: history unchanged
    assert len((await store.runs.find(NS, "run-1"))[0].history) == 1
    await store.runs.set_state(NS, "run-1", None, 302.0, event={"event": "note"}, next_restart_at=9.0)
    [run] = await store.runs.find(NS, "run-1")  # None keeps the state
    assert (run.state, run.next_restart_at, run.history[-1]["event"]) == (RunState.DEAD, 9.0, "note")
    with pytest.raises(ValueError):
        await store.runs.set_state(NS, "run-1", RunState.RUNNING, 1.0, epoch=9)
    await store.runs.set_state(NS, f"missing-{uuid.uuid4().hex}", RunState.RUNNING, 1.0)  # nothing to do


async def test_count_runs_by_state(store):
    assert await store.runs.count() == {}
    for run_id in ("a", "b", "c"):
        await store.runs.upsert(new_run(run_id))
    await store.runs.end(NS, "c", RunState.COMPLETED, time.time())
    await store.runs.new_attempt(NS, "b", 0, time.time(), "restart", True)
    assert await store.runs.count() == {RunState.RUNNING: 1, RunState.RESTARTING: 1, RunState.COMPLETED: 1}


async def test_heartbeat_and_end_run_are_fenced_by_the_epoch(store):
    await store.runs.upsert(new_run("run-1", last_seen=100.0))
    await store.runs.new_attempt(NS, "run-1", 0, 150.0, "restart", True)
    stale = await store.runs.heartbeat(NS, "run-1", 200.0, epoch=0)  # a superseded attempt
    assert (stale.epoch, stale.last_seen, stale.state) == (1, 150.0, RunState.RESTARTING)  # untouched
    beat = await store.runs.heartbeat(NS, "run-1", 210.0, epoch=1)
    assert (beat.last_seen, beat.state) == (210.0, RunState.RUNNING)
    assert (await store.runs.heartbeat(NS, "run-1", 205.0)).last_seen == 210.0  # unfenced; never backwards
    assert await store.runs.heartbeat(NS, "no-such-run", 1.0, epoch=0) is None

    refused = await store.runs.end(NS, "run-1", RunState.COMPLETED, 300.0, epoch=0)
    assert (refused.state, refused.ended_at, refused.epoch) == (RunState.RUNNING, None, 1)
    assert (await store.runs.find(NS, "run-1"))[0].state == RunState.RUNNING
    ended = await store.runs.end(NS, "run-1", RunState.COMPLETED, 310.0, epoch=1)
    assert (ended.state, ended.ended_at) == (RunState.COMPLETED, 310.0)
    assert (await store.runs.end(NS, "run-1", RunState.FAILED, 320.0, epoch=5)).state == RunState.COMPLETED  # once


async def test_heartbeats_that_come_together_are_each_answered_as_alone(store):
    """The runs API's heartbeats may share one write (PostgreSQL, Redis): each caller still
    learns its own run, fenced by its own epoch, whatever else went along."""
    for run_id in ("a", "b"):
        await store.runs.upsert(new_run(run_id, last_seen=100.0))
    await store.runs.new_attempt(NS, "b", 0, 150.0, "restart", True)
    beats = await asyncio.gather(
        store.runs.heartbeat(NS, "a", 200.0, epoch=0),
        store.runs.heartbeat(NS, "b", 210.0, epoch=0),  # superseded: b is at epoch 1
        store.runs.heartbeat(NS, "b", 205.0, epoch=1),
        store.runs.heartbeat(NS, "b", 190.0),  # unfenced, older: never backwards
        store.runs.heartbeat(NS, "missing", 200.0, epoch=0),
        store.runs.heartbeat("other-namespace", "a", 200.0))
    a, stale, b, unfenced, missing, elsewhere = beats
    assert (a.run_id, a.last_seen, a.state) == ("a", 200.0, RunState.RUNNING)
    assert (stale.epoch, stale.run_id) == (1, "b")  # the run as it is: the caller is told it is fenced
    assert (b.last_seen, b.state, unfenced.last_seen) == (205.0, RunState.RUNNING, 205.0)
    assert missing is None and elsewhere is None
    [b] = await store.runs.find(NS, "b")
    assert (b.epoch, b.last_seen, b.state) == (1, 205.0, RunState.RUNNING)


async def test_only_a_dead_run_is_revived_with_its_restarts_forgotten(store, open_store):
    await store.runs.upsert(new_run("run-1"))
    for i, at in enumerate((100.0, 110.0)):
        await store.runs.new_attempt(NS, "run-1", i, at, "restart", True, window_s=600)
    assert await store.runs.revive(NS, "run-1", 150.0) is None  # not dead
    await store.runs.end(NS, "run-1", RunState.DEAD, 120.0)
    other = await open_store()
    first, second = await asyncio.gather(store.runs.revive(NS, "run-1", 200.0),
                                         other.runs.revive(NS, "run-1", 200.0))
    revived = first or second
    assert (first is None) != (second is None)  # one operator's revive wins
    assert (revived.state, revived.epoch, revived.restarts, revived.ended_at, revived.restart_times,
            revived.started_at, revived.last_seen) == (RunState.RESTARTING, 3, 3, None, [], 200.0, 200.0)
    assert revived.history[-1] == {"at": 200.0, "epoch": 3, "event": "revive"}
    [run] = await store.runs.find(NS, "run-1")
    assert (run.state, run.epoch, run.ended_at, run.restart_times) == (RunState.RESTARTING, 3, None, [])
    assert [r.run_id for r in await store.runs.silent(200.0 + 61 + 31)] == ["run-1"]  # watched again
    await store.runs.upsert(new_run("run-2"))
    await store.runs.end(NS, "run-2", RunState.COMPLETED, 130.0)
    assert await store.runs.revive(NS, "run-2", 200.0) is None  # completed runs stay ended
    assert await store.runs.revive(NS, "no-such-run", 200.0) is None


async def test_restart_times_keep_the_window_apart_from_the_history(store):
    await store.runs.upsert(new_run("run-1"))
    for i, at in enumerate((100.0, 150.0, 190.0, 260.5)):
        run = await store.runs.new_attempt(NS, "run-1", i, at, "restart", True, window_s=100)
    assert run.restart_times == [190.0, 260.5]  # 100 and 150 are more than 100s before 260.5
    run = await store.runs.new_attempt(NS, "run-1", 4, 270.0, "admin-restart", True)  # not counted
    assert (run.restarts, run.restart_times) == (5, [190.0, 260.5])
    for i in range(60):  # events enough to push every restart out of the history
        await store.runs.set_state(NS, "run-1", None, 280.0 + i, {"event": "hook-exit"})
    [run] = await store.runs.find(NS, "run-1")
    assert run.restart_times == [190.0, 260.5] and not any(e["event"] == "restart" for e in run.history)
    assert (await store.runs.upsert(new_run("run-2", restart_times=[5.0]))).restart_times == [5.0]


async def test_count_steps_of_runs(store):
    for key in ("s1", "s2"):
        await claimed(store, scope(key))
    await claimed(store, scope("s3", tenant="tenant-b"))  # same run, another credential
    await claimed(store, scope("s1", run="run-2"))
    await claimed(store, scope("s1", tenant="tenant-c"), namespace="ns-b")
    counts = await store.journal.count_steps([(NS, "run-1"), (NS, "run-2"), ("ns-b", "run-1"), (NS, "none")])
    assert counts == {(NS, "run-1"): 3, (NS, "run-2"): 1, ("ns-b", "run-1"): 1}
    assert await store.journal.count_steps([]) == {}


# -- lost attempts and held connections -----------------------------------------------------

async def test_a_lost_attempt_is_due_at_once_until_its_restart(store):
    now = time.time()
    await store.runs.upsert(new_run("crashed", last_seen=now, started_at=now, timeout_s=60, grace_s=30))
    await store.runs.upsert(new_run("alive", last_seen=now, started_at=now, timeout_s=60, grace_s=30))
    assert await store.runs.silent(now) == []
    exited = {"event": "hook-exit", "epoch": 0, "code": None, "signal": "SIGKILL"}
    assert await store.runs.lose(NS, "crashed", 0, now, exited)
    [run] = await store.runs.silent(now)  # in its grace, far from its timeout: due all the same
    assert (run.run_id, run.lost, run.lost_epoch) == ("crashed", True, 0)
    assert run.history[-1] == {"at": now, **exited}
    assert not await store.runs.lose(NS, "crashed", 0, now + 1, exited)  # once
    await store.runs.set_state(NS, "crashed", None, now, next_restart_at=now + 5)  # backing off
    assert await store.runs.silent(now) == []
    assert [r.run_id for r in await store.runs.silent(now + 5)] == ["crashed"]
    restarted = await store.runs.new_attempt(NS, "crashed", 0, now + 5, "restart", True)
    assert not restarted.lost  # the new attempt is not the lost one
    assert await store.runs.silent(now + 6) == []
    # no hook to start it again (a Kubernetes Job restarts it): its timeout decides, as before
    await store.runs.upsert(new_run("hookless", last_seen=now, started_at=now, timeout_s=60, grace_s=30,
                                   hook=None))
    assert await store.runs.lose(NS, "hookless", 0, now, exited)
    assert await store.runs.silent(now + 6) == []
    assert "hookless" in {r.run_id for r in await store.runs.silent(now + 61)}


async def test_only_the_current_live_attempt_can_be_lost(store):
    await store.runs.upsert(new_run("run-1"))
    await store.runs.new_attempt(NS, "run-1", 0, 100.0, "restart", True)
    event = {"event": "hook-exit", "epoch": 0}
    assert not await store.runs.lose(NS, "run-1", 0, 101.0, event)  # superseded: nothing changes
    assert not await store.runs.lose(NS, "run-1", 2, 101.0, event)  # not yet
    assert not await store.runs.lose(NS, "no-such-run", 0, 101.0, event)
    await store.runs.end(NS, "run-1", RunState.COMPLETED, 102.0)
    assert not await store.runs.lose(NS, "run-1", 1, 103.0, event)  # completed: never restarted
    [run] = await store.runs.find(NS, "run-1")
    assert run.lost_epoch is None and not any(e["event"] == "hook-exit" for e in run.history)


async def test_a_dropped_connection_loses_its_attempt_only_if_none_was_held_since(store):
    await store.runs.upsert(new_run("run-1"))
    first = await store.runs.attach(NS, "run-1", 0)
    second = await store.runs.attach(NS, "run-1", 0)  # the client reconnected (to any replica)
    assert (first.attachments, second.attachments) == (1, 2)
    gone = {"event": "attachment-lost", "epoch": 0}
    assert not await store.runs.lose(NS, "run-1", 0, 100.0, gone, attachment=1)
    assert await store.runs.lose(NS, "run-1", 0, 101.0, gone, attachment=2)
    # a lost attempt takes no new connection; another epoch's or an ended run's neither
    assert (await store.runs.attach(NS, "run-1", 0)).attachments == 2
    await store.runs.new_attempt(NS, "run-1", 0, 102.0, "restart", True)
    assert (await store.runs.attach(NS, "run-1", 0)).attachments == 2
    assert (await store.runs.attach(NS, "run-1", 1)).attachments == 3
    await store.runs.end(NS, "run-1", RunState.FAILED, 103.0)
    assert (await store.runs.attach(NS, "run-1", 1)).attachments == 3
    assert await store.runs.attach(NS, "no-such-run", 0) is None


async def test_a_lost_attempt_rings_every_instance(store, open_store, store_url):
    other = await open_store()  # a supervisor on another replica
    await store.runs.upsert(new_run("run-1"))
    assert not await other.runs.wait_lost(0.05)
    waiting = asyncio.create_task(other.runs.wait_lost(5.0))
    await asyncio.sleep(0.05)
    assert await store.runs.lose(NS, "run-1", 0, time.time(), {"event": "attachment-lost", "epoch": 0})
    if store_url.startswith("sqlite:"):
        waiting.cancel()  # SQLite has no channel: only its own process hears at once
        assert await store.runs.wait_lost(0.05)
        return
    assert await waiting
    assert await store.runs.wait_lost(1.0)  # and the instance that marked it
    assert not await store.runs.wait_lost(0.05)  # heard once


# -- what operators and the registration limits ask ---------------------------------------

async def test_kids_are_found_by_their_start(store):
    kids = [scope(f"key:{n}").kid for n in range(40)]
    for n in range(40):
        await claimed(store, scope(f"key:{n}"))
    for kid in kids[:5]:
        assert await store.journal.kids(kid[:10], 2) == [kid]
    digit = max("0123456789abcdef", key=lambda d: sum(k.startswith(d) for k in kids))
    sharing = sorted(k for k in kids if k.startswith(digit))  # 40 kids, 16 digits: two at least
    assert sorted(await store.journal.kids(digit, 100)) == sharing
    [one] = await store.journal.kids(digit, 1)
    assert one in sharing
    assert await store.journal.kids("f" * 20, 2) == []


async def test_live_counts_a_namespaces_runs_not_ended(store):
    for n in range(4):
        await store.runs.upsert(new_run(f"run-{n}"))
    await store.runs.upsert(new_run("run-0", tenant="ns-b"))
    await store.runs.end(NS, "run-0", RunState.COMPLETED, time.time())
    assert await store.runs.live(NS, 100) == 3
    assert await store.runs.live(NS, 2) == 2  # counted no further than asked
    assert await store.runs.live("ns-b", 100) == 1
    assert await store.runs.live("ns", 100) == 0  # a namespace that starts another's name


async def test_refusals_are_counted_per_run_and_the_last_kept(store, open_store):
    now = time.time()
    for n in range(7):
        await store.audit.refused(NS, "run-1", {"at": now + n, "epoch": 0, "status": 412, "type": "stale-epoch",
                                                "n": n}, 5, 60)
    await store.audit.refused("ns-b", "run-1", {"at": now, "epoch": 3, "status": 409}, 5, 60)
    other = await open_store()  # another replica sees the same counts
    count, recent = await other.audit.refusals(NS, "run-1")
    assert count == 7 and [r["n"] for r in recent] == [2, 3, 4, 5, 6]
    assert await store.audit.refusals("ns-b", "run-1") == (1, [{"at": now, "epoch": 3, "status": 409}])
    assert await store.audit.refusals(NS, "run-2") == (0, [])
    await store.audit.refused(NS, "gone", {"at": now - 100, "epoch": 0, "status": 502}, 5, 10)
    assert await store.audit.refusals(NS, "gone") == (0, [])  # past its retention
    await store.audit.purge(now)
    assert (await store.audit.refusals(NS, "run-1"))[0] == 7


async def test_events_are_counted_for_every_replica_within_their_window(store, open_store):
    now = time.time()  # Redis expires the counters by the clock
    other = await open_store()
    for replica in (store, other, store):
        await replica.audit.count_events(["wrong-token 10.0.0.1", "wrong-token"], 60, now)
    await other.audit.count_events(["wrong-token 10.0.0.1"], 60, now + 30)
    await other.audit.count_events(["wrong-token 10.0.0.2", "wrong-token"], 60, now)
    seen = await store.audit.events("wrong-token 10.0.0.1", 60, now + 30)
    assert sum(n for _, n in seen) == 4 and all(at <= now + 30 for at, _ in seen)
    assert sum(n for _, n in await store.audit.events("wrong-token 10.0.0.1", 60, now + 75)) == 1  # a window on
    assert await store.audit.events("wrong-token 10.0.0.1", 60, now + 200) == []
    assert sum(n for _, n in await other.audit.events("wrong-token", 60, now + 1)) == 4
