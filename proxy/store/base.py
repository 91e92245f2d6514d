"""The store contract: the journal, the runs, and the server's secrets.

Every backend (sqlite, postgres, redis) implements :class:`Store` (its ``journal`` and
its ``runs``) and passes the one
contract suite in ``tests/test_store_contract.py``. Errors a driver raises are
translated inside the backend::

    StoreError
    ├── StoreUnavailable    the store cannot be reached or did not answer in time: retried
    ├── StoreMisconfigured  the store answered that it never will serve this URL as it is
    │                       (no such database or folder, a database index out of range,
    │                       credentials refused): not retried, start-up fails at once
    ├── SchemaNotCurrent    opened without migrating, the store has no schema or an older
    │                       one: ``idemproxy migrate`` (or ``serve``) brings it up to date
    └── (programming errors are not translated)

Times are UNIX seconds (float). A journal entry is addressed by its ``kid``, a hash of
its :class:`Scope`, so tenants and runs can never collide.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from ..config import RunSettings



class EntryState(StrEnum):
    """Where a journal entry is in its life (stored as these strings)."""
    IN_FLIGHT = "in_flight"        # claimed; the call is upstream now
    COMPLETE = "complete"          # the outcome is recorded: replays answer it
    UNKNOWN = "unknown"            # quarantined: the upstream may have acted; an operator decides
    UNRECORDABLE = "unrecordable"  # answered once, too large to keep: replays get 409
    # quarantined, then resolved by an operator as retry: kept (findable, with its evidence
    # and its audit), and the next claim of its key takes it over and goes upstream
    RETRIED = "retried"


class RunState(StrEnum):
    """A run's state (SPEC §8), in the order listings show them."""
    RUNNING = "running"
    RESTARTING = "restarting"
    COMPLETED = "completed"
    FAILED = "failed"
    DEAD = "dead"


ENDED = frozenset({RunState.COMPLETED, RunState.FAILED, RunState.DEAD})
RUN_STATES = tuple(RunState)
HISTORY_LIMIT = 50  # a run keeps its last 50 events
_RUN_DEFAULTS = RunSettings()


class StoreError(Exception):
    """Base of the store's errors."""


class StoreUnavailable(StoreError):
    """The store cannot be reached, or did not answer within its timeout."""


class StoreMisconfigured(StoreError):
    """The store answered, and will never serve this URL as it is: retrying cannot help."""


class SchemaNotCurrent(StoreError):
    """Opened with ``migrate=False``, the store has no schema yet, or an older one."""


@dataclass(frozen=True, slots=True)
class Scope:
    """Where a journal entry lives: (tenant, run or none, upstream, key)."""
    tenant: str
    run: str | None
    upstream: str
    key: str
    # the entry's address: worked out once (a record asks for it three times)
    kid: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        raw = "\0".join((self.tenant, self.run or "", self.upstream, self.key))
        object.__setattr__(self, "kid", hashlib.sha256(raw.encode()).hexdigest())

    @classmethod
    def of_key(cls, tenant: str, run: str | None, upstream: str, idempotency_key: str) -> "Scope":
        """The scope of an agent's own ``Idempotency-Key``; prefixed, so that no agent key can
        pose as a derived one (``derived:<fingerprint>:<n>``)."""
        return cls(tenant, run, upstream, cls.agent_key(idempotency_key))

    @staticmethod
    def agent_key(idempotency_key: str) -> str:
        """How an agent's own ``Idempotency-Key`` is kept as an entry's ``key``."""
        return "key:" + idempotency_key


@dataclass(slots=True)
class Recorded:
    """An upstream answer as kept in the journal (headers already stripped of secrets)."""
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    streamed: bool = False
    # (byte offset, seconds since the first byte) per chunk, for replays paced as recorded
    timing: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class Entry:
    kid: str
    tenant: str
    run: str | None
    epoch: int | None
    upstream: str
    key: str
    fingerprint: str
    state: EntryState
    owner: str | None = None
    lease_until: float = 0.0
    created_at: float = 0.0
    completed_at: float | None = None
    expires_at: float = 0.0
    replays: int = 0
    detail: str | None = None
    method: str = ""
    path: str = ""
    namespace: str = "default"  # of the run, so a run's journal spans all its tenants
    response: Recorded | None = None
    # replays by the epoch of the run when they were counted: {epoch: (replays, first seen)};
    # read by entries() and search() for the console's timeline, not by get()
    replayed: dict[int, tuple[int, float]] = field(default_factory=dict)
    # what an operator needs to decide a quarantined call (proxy/evidence.py), kept by
    # quarantine() and read by get(): the request and the upstream's partial or error answer
    evidence: dict[str, Any] | None = None


# The detail of an entry an operator resolved with an answer (its replays return it): the
# answer is the operator's, not the upstream's, and its time is the operator's thinking time
ANSWERED_BY_OPERATOR = "resolved by operator"


@dataclass(frozen=True, slots=True)
class Action:
    """One operator action, kept for the journal's retention: ``action`` is
    resolve-retry, resolve-respond, revive, restart, complete or delete-journal; ``by`` the
    operator (proxy/runs/operators.py); ``kid`` the entry it decided, if any; ``detail`` its
    facts (a respond's status and body digest, entries deleted, the epoch started)."""
    at: float
    by: str
    action: str
    namespace: str | None = None
    run: str | None = None
    kid: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"at": self.at, "by": self.by, "action": self.action, "namespace": self.namespace,
                "run": self.run, "kid": self.kid, "detail": self.detail}

    @classmethod
    def of_json(cls, raw: dict[str, Any]) -> "Action":
        return cls(float(raw["at"]), str(raw["by"]), str(raw["action"]), raw.get("namespace"), raw.get("run"),
                   raw.get("kid"), dict(raw.get("detail") or {}))


@dataclass(frozen=True, slots=True)
class Claim:
    """Ask to own a key. ``derived`` keys get their occurrence number from the store."""
    scope: Scope
    fingerprint: str
    owner: str
    lease_s: float
    retention_s: float
    method: str = ""
    path: str = ""
    epoch: int | None = None
    # what to do with a claim whose lease expired (its proxy died): "retry" or "quarantine"
    on_expired: str = "retry"
    # the namespace of the run (runs are not keyed by credential; see identity.py)
    namespace: str = "default"

    def entry(self, now: float) -> Entry:
        """The in-flight entry this claim makes when it wins at ``now``."""
        scope = self.scope
        return Entry(scope.kid, scope.tenant, scope.run, self.epoch, scope.upstream, scope.key,
                     self.fingerprint, EntryState.IN_FLIGHT, self.owner, now + self.lease_s, now, None,
                     now + self.retention_s, method=self.method, path=self.path,
                     namespace=self.namespace)


@dataclass(slots=True)
class ClaimResult:
    won: bool
    entry: Entry | None      # ours when won; the existing one otherwise
    stale_epoch: int | None = None  # set when the run has moved past the claim's epoch


@dataclass(slots=True)
class Run:
    namespace: str  # the trusted tenant, or "default" (identity.TenantResolver.namespace)
    run_id: str
    state: RunState = RunState.RUNNING
    epoch: int = 0
    restarts: int = 0
    last_seen: float = 0.0
    started_at: float = 0.0  # start of the current attempt; grace counts from here
    # defaults declared once, in RunSettings
    timeout_s: float = _RUN_DEFAULTS.timeout_s
    grace_s: float = _RUN_DEFAULTS.grace_s
    max_restarts: int = _RUN_DEFAULTS.max_restarts
    hook: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0
    ended_at: float | None = None
    next_restart_at: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)  # the last HISTORY_LIMIT events
    # times of the restarts that count towards max_restarts, within the restart window;
    # kept apart from the history, whose other events would push them out
    restart_times: list[float] = field(default_factory=list)
    # The epoch of an attempt found lost (its process exited, its held connection stayed
    # gone): the supervisor restarts it at once, whatever timeout_s says. Older values
    # mean nothing once the epoch has moved on.
    lost_epoch: int | None = None
    # Held connections (POST /runs/{id}/attach) made so far: a connection that drops marks
    # its attempt lost only if none was made after it, on any replica.
    attachments: int = 0

    @property
    def lost(self) -> bool:
        """Whether the current attempt has been found lost."""
        return self.lost_epoch == self.epoch

    @classmethod
    def new(cls, namespace: str, run_id: str, defaults: RunSettings, now: float) -> "Run":
        """A run at epoch 0 with the configured ``[runs]`` defaults, started ``now``."""
        return cls(namespace, run_id, epoch=0, last_seen=now, started_at=now, created_at=now,
                   timeout_s=defaults.timeout_s, grace_s=defaults.grace_s,
                   max_restarts=defaults.max_restarts, hook=defaults.hook)


# Runs one silent() call returns at most: a supervisor tick handles that many and leaves the
# rest to its next tick, so a mass silence costs a tick a bounded read
SILENT_LIMIT = 1000

# What set_run_state may set besides the state (the supervisor's bookkeeping; claimed_until,
# kept by the store alone, ends a supervisor's claim from silent())
SETTABLE_RUN_FIELDS = frozenset({"next_restart_at", "restarts", "ended_at", "claimed_until"})


def check_settable(fields: dict[str, Any]) -> None:
    """Refuse to set_run_state anything but SETTABLE_RUN_FIELDS."""
    if set(fields) - SETTABLE_RUN_FIELDS:
        raise ValueError(f"cannot set {set(fields) - SETTABLE_RUN_FIELDS}")


def ending_event(now: float, epoch: int, ended: dict[str, Any]) -> dict[str, Any]:
    """The history event of how attempt ``epoch`` ended (``ended``: proxy/runs/endings.py)."""
    return {"at": now, "epoch": epoch, "event": "ended", **ended}


def remembered(history: list[dict[str, Any]], event: dict[str, Any]) -> list[dict[str, Any]]:
    """``history`` with ``event`` added, keeping the last HISTORY_LIMIT events."""
    return (history + [event])[-HISTORY_LIMIT:]


def counted(tenant: str, fingerprint: str) -> str:
    """What the occurrences of derived keys are counted by, within a run's epoch: the
    tenant's calls alike, so another credential's calls in a shared namespace never shift
    the numbers (every backend keeps its counters under this)."""
    return f"{tenant} {fingerprint}"


def advance_attempt(run: Run, now: float, reason: str, restart: bool, window_s: float | None,
                    ended: dict[str, Any] | None = None) -> None:
    """Move ``run`` to its next attempt, in memory: the one rule every backend stores.

    The epoch goes up by one (fencing the attempt before), the start and the last sign
    of life are now, and a restart counts towards ``max_restarts`` when ``window_s`` is
    given (the supervisor's restarts), remembering only those within the window. With
    ``ended``, how the attempt before ended is remembered first (:func:`ending_event`).
    """
    if ended is not None:
        run.history = remembered(run.history, ending_event(now, run.epoch, ended))
    run.epoch += 1
    run.restarts += int(restart)
    run.state = RunState.RESTARTING if restart else RunState.RUNNING
    run.started_at = run.last_seen = now
    run.history = remembered(run.history, {"at": now, "epoch": run.epoch, "event": reason})
    if window_s is not None:
        run.restart_times = [t for t in run.restart_times if t > now - window_s] + [now]


# The word the postgres and redis stores broadcast on their channel when an attempt is
# marked lost; never a kid (those are hex), so it needs no channel of its own.
RUN_LOST = "run-lost"


class Bell:
    """Rung when an attempt is marked lost, by this process or (heard through NOTIFY or
    pub/sub) another one; a supervisor waiting on it ticks at once. It stays rung until
    someone has waited on it, so a ring during a tick is not lost."""

    def __init__(self) -> None:
        self._rung = asyncio.Event()

    def ring(self) -> None:
        self._rung.set()

    async def wait(self, timeout: float) -> bool:
        """True once rung (and unrung again), False after ``timeout``."""
        try:
            await asyncio.wait_for(self._rung.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        self._rung.clear()
        return True


def tallied(replayed: dict[int, tuple[int, float]], epoch: int, n: int,
            now: float) -> dict[int, tuple[int, float]]:
    """``replayed`` with ``n`` more replays in ``epoch``, first seen ``now`` if it is new there."""
    count, first = replayed.get(epoch, (0, now))
    return {**replayed, epoch: (count + n, first)}


def replayed_from(raw: dict[str, Any] | None) -> dict[int, tuple[int, float]]:
    """``Entry.replayed`` from its stored JSON form ``{"epoch": [replays, first seen]}``."""
    return {int(epoch): (int(n), float(first)) for epoch, (n, first) in (raw or {}).items()}


def revive_attempt(run: Run, now: float) -> None:
    """Bring a dead run back, in memory: its next attempt, restarting, as ``advance_attempt``
    makes it, and no longer ended. The restarts that killed it are forgotten: an operator
    decided to try again, so the intensity rule (``max_restarts``) counts from here."""
    advance_attempt(run, now, "revive", restart=True, window_s=None)
    run.ended_at = None
    run.next_restart_at = 0.0
    run.restart_times = []


class Waiters:
    """Callers waiting in this process for a journal entry to change.

    A backend calls :meth:`wake` when it learns of a change (its own write, a NOTIFY, a
    pub/sub message); :meth:`wait` also returns after ``poll_s``, so a lost notification
    costs a poll, never a hang. An event lives only while someone waits on it.
    """

    def __init__(self, poll_s: float):
        self.poll_s = poll_s
        self._events: dict[str, asyncio.Event] = {}
        self._waiting: dict[str, int] = {}

    def wake(self, kid: str) -> None:
        event = self._events.pop(kid, None)
        if event is not None:
            event.set()

    def wake_all(self) -> None:
        events, self._events = self._events, {}
        for event in events.values():
            event.set()

    async def wait(self, kid: str, timeout: float) -> None:
        event = self._events.get(kid)
        if event is None:
            event = self._events[kid] = asyncio.Event()
        self._waiting[kid] = self._waiting.get(kid, 0) + 1
        try:
            await asyncio.wait_for(event.wait(), min(timeout, self.poll_s))
        except asyncio.TimeoutError:
            pass
        finally:
            left = self._waiting.pop(kid) - 1
            if left:
                self._waiting[kid] = left
            elif self._events.get(kid) is event:
                del self._events[kid]


@runtime_checkable
class Journal(Protocol):
    """Journal entries: claimed, completed or quarantined, replayed, purged (SPEC §4-§6)."""

    async def get(self, kid: str) -> Entry | None: """The live entry, with its response."""
    async def claim(self, claim: Claim) -> ClaimResult:
        """Own ``claim.scope`` unless taken; a taken key is answered with its live entry (the
        proxy asks nothing else first: a new key costs two store calls, claim and complete)."""
    async def next_occurrence(self, namespace: str, run: str, epoch: int | None, fingerprint: str,
                              retention_s: float, *, tenant: str) -> int:
        """Count of earlier calls alike in the run's epoch by ``tenant`` (see ``counted``)."""
    async def replay_occurrence(self, namespace: str, run: str, epoch: int, fingerprint: str,
                                retention_s: float, *, tenant: str) -> int | None:
        """next_occurrence (counted per ``tenant`` alike) for an attempt replaying from memory,
        with its fence in the same step: None, counting nothing, unless the run is at ``epoch``.
        Committed (every proxy counts on from it) but not forced to disk: see README, "Replay
        in one read"."""
    async def recorded(self, namespace: str, run: str, max_bytes: int) -> tuple[dict[str, Entry], bool]:
        """A run's complete, unexpired entries (every tenant's) with their responses, by kid,
        in one read: the oldest whose bodies fit in ``max_bytes``; and whether that is all."""
    async def renew(self, kid: str, owner: str, lease_s: float) -> bool: """Extend a lease."""
    async def complete(self, kid: str, owner: str, recorded: Recorded) -> bool:
        """Durably record the outcome; False if the claim was lost."""
    async def release(self, kid: str, owner: str) -> None: """Give the key back: nothing happened."""
    async def quarantine(self, kid: str, owner: str | None, detail: str,
                         evidence: dict[str, Any] | None = None) -> None:
        """Keep the key as outcome-unknown, with ``evidence`` for the operator (``Entry.evidence``).
        For in-flight entries (``owner`` None: whoever holds it); never a complete one, which
        proxies may hold in memory (see ``generation``)."""
    async def mark_unrecordable(self, kid: str, owner: str, detail: str) -> None:
        """The response was too large to keep."""
    async def resolve(self, kid: str, recorded: Recorded | None) -> bool:
        """Operator decision on an unknown key: None = retry (the entry stays, ``retried``, until
        the next claim of its key takes it over), else the answer to replay."""
    async def append_partial(self, kid: str, owner: str, seq: int, data: bytes) -> None:
        """Bytes of a stream still in flight, so other proxies can join it."""
    async def read_partial(self, kid: str, after_seq: int) -> list[tuple[int, bytes]]: ...
    async def wait(self, kid: str, timeout: float) -> None:
        """Return when ``kid`` may have changed (or after ``timeout``)."""
    async def count_replays(self, counts: dict[str, int]) -> None:
        """Add replay counts, each also tallied in ``Entry.replayed`` under the current epoch of
        the entry's run (an entry without a run only counts)."""
    async def purge(self, now: float, batch: int = 1000) -> int: """Delete expired entries."""
    async def entries(self, namespace: str, run: str) -> list[Entry]:
        """A run's entries (every tenant's), oldest first, with status but no body."""
    async def delete_run(self, namespace: str, run: str) -> int:
        """Delete a run's entries, and raise the generation in the same transaction."""
    async def generation(self) -> int:
        """The journal's invalidation generation: 0 at first, raised by every change to complete
        entries other than their expiry (``delete_run``; a resolve changes quarantined entries
        only). Entries held in memory answer only under the generation they were read in
        (proxy/freshness.py). Raised in the same transaction as the change, never before it:
        a read that sees the new generation then also sees the change."""
    async def count_steps(self, runs: list[tuple[str, str]]) -> dict[tuple[str, str], int]:
        """Journal entries of each (namespace, run) not purged yet; runs without any are left out."""
    async def search(self, *, state: str | None = None, key: str | None = None, tenant: str | None = None,
                     run: str | None = None, limit: int = 100) -> list[Entry]:
        """Live entries matching every filter given (``key`` as stored, e.g. ``key:<agent's key>``),
        newest first, at most ``limit``, with status but no body. For operators: it may scan."""
    async def kids(self, prefix: str, limit: int) -> list[str]:
        """Kids that start with ``prefix`` (lowercase hex), at most ``limit``: for operators,
        who name an entry by the start of its kid. It may scan."""
    async def count_quarantined(self) -> int:
        """Live entries whose outcome is unknown (``idemproxy_journal_quarantined``): indexed."""


@runtime_checkable
class Audit(Protocol):
    """Operator actions: appended, read by entry or by run, gone after ``retention_s``; the
    refusals runs' attempts got; events counted across processes (proxy/ratelimit.py)."""

    async def note(self, action: Action, retention_s: float) -> None: """Keep ``action``."""
    async def of_entry(self, kid: str) -> list[Action]: """The actions on entry ``kid``, oldest first."""
    async def of_run(self, namespace: str, run: str) -> list[Action]:
        """The actions on the run and on its entries, oldest first."""
    async def purge(self, now: float) -> int:
        """Delete the actions, refusals and event counts kept past their retention."""
    async def refused(self, namespace: str, run: str, refusal: dict[str, Any], keep: int,
                      retention_s: float) -> None:
        """Count a refusal a run's attempt got, keeping the last ``keep`` (one write)."""
    async def refusals(self, namespace: str, run: str) -> tuple[int, list[dict[str, Any]]]:
        """(how many refusals the run got, the last few of them, oldest first)."""
    async def count_events(self, names: list[str], window_s: float, now: float) -> None:
        """Count one event of each of ``names`` (a wrong token, a registration), for every
        process, in one write."""
    async def events(self, name: str, window_s: float, now: float) -> list[tuple[float, int]]:
        """``name``'s events within the last ``window_s``: (start of their bucket, how many)."""


# Events are counted in EVENT_BUCKETS buckets per window: a window read back is the buckets it
# overlaps, so it may reach up to one bucket further back than ``window_s`` (never less far).
EVENT_BUCKETS = 6


def event_bucket(window_s: float, now: float) -> tuple[int, float]:
    """(the number of the bucket ``now`` falls in, that bucket's size) for a window."""
    size = window_s / EVENT_BUCKETS
    return int(now // size), size


@runtime_checkable
class RunRegistry(Protocol):
    """Runs: epochs, heartbeats, attempts and ends (SPEC §8)."""

    async def upsert(self, run: Run) -> Run: """Create, or update timeouts/hook/metadata."""
    async def find(self, namespace: str | None, run_id: str) -> list[Run]:
        """The run in ``namespace``; with None, the runs of that id in every namespace."""
    async def list(self, state: str | None = None, limit: int = 1000) -> list[Run]: ...
    async def observe_epoch(self, namespace: str, run_id: str, epoch: int | None, defaults: Run,
                            now: float, ended: dict[str, Any] | None = None) -> int:
        """Create the run if new (from ``defaults``, at ``epoch`` or 0); raise its epoch to
        ``epoch`` when that is the next one (current + 1), remembering ``ended`` as how the
        attempt before ended (:func:`ending_event`) in the same change; return the epoch
        afterwards. An ``epoch`` further ahead changes nothing, and creates no run unless it
        is 0 or 1 (an unknown run counts as one at epoch 0): only new attempts move a run further."""
    async def touch(self, beats: dict[tuple[str, str, int | None], float]) -> None:
        """Coalesced heartbeats, {(namespace, run_id, epoch): at}: each as ``heartbeat`` does,
        unless the run is past its epoch (None: unfenced)."""
    async def heartbeat(self, namespace: str, run_id: str, now: float,
                        epoch: int | None = None) -> Run | None:
        """One beat from outside the proxy, as ``touch`` does, unless the run is past ``epoch``
        (a superseded attempt: nothing changes). The run afterwards; None if there is none."""
    async def end(self, namespace: str, run_id: str, state: str, now: float,
                  epoch: int | None = None, ended: dict[str, Any] | None = None) -> Run | None:
        """End the run as ``state``, unless it has ended already or is past ``epoch`` (then
        nothing changes). The run afterwards; None if there is none. ``ended``: how its
        attempt ended, remembered as its ``ended`` event (proxy/runs/endings.py)."""
    async def new_attempt(self, namespace: str, run_id: str, expected_epoch: int | None, now: float,
                          reason: str, restart: bool, window_s: float | None = None,
                          ended: dict[str, Any] | None = None) -> Run | None:
        """Compare-and-set the epoch to epoch+1; None when another caller won. With
        ``window_s``, ``now`` joins ``restart_times``, which keeps the last ``window_s`` seconds.
        ``ended``: how the attempt before ended, remembered as its ``ended`` event."""
    async def silent(self, now: float, limit: int = SILENT_LIMIT, claim_s: float = 0.0) -> list[Run]:
        """Running runs past timeout and grace, or whose attempt is lost and which have a hook
        to start them again (without one, something else restarts them: silence decides);
        none backing off. At most ``limit``, soonest due first, found through an index of
        when each is due: the cost follows the runs due, not the runs kept. With ``claim_s``,
        the runs returned are claimed: no caller sees them again for ``claim_s`` seconds,
        so supervisors ticking together share the runs due. A new attempt ends the claim, as
        does ``set_state(claimed_until=0)``. A claim only shares work: a restart is still
        decided by the epoch's compare-and-set (``new_attempt``)."""
    async def attach(self, namespace: str, run_id: str, epoch: int) -> Run | None:
        """Count a held connection of attempt ``epoch`` (``attachments`` + 1), unless the run
        has ended, is at another epoch or that attempt is lost (then nothing changes). The run
        afterwards; None if there is none."""
    async def lose(self, namespace: str, run_id: str, epoch: int, now: float, event: dict[str, Any],
                   attachment: int | None = None) -> bool:
        """Mark attempt ``epoch`` lost and remember ``event``: only while the run is at that
        epoch and not ended, and with ``attachment``, only if no connection was held after
        that one. True if marked (and the bell rung for every supervisor)."""
    async def wait_lost(self, timeout: float) -> bool:
        """True when an attempt was marked lost since the last call, False after ``timeout``."""
    async def revive(self, namespace: str, run_id: str, now: float) -> Run | None:
        """A dead run's next attempt (see :func:`revive_attempt`); None unless the run is dead."""
    async def set_state(self, namespace: str, run_id: str, state: str | None, now: float,
                        event: dict[str, Any] | None = None, **fields: Any) -> None:
        """Set state (None keeps it), append ``event`` to the history, set ``fields``."""
    async def count(self) -> dict[str, int]: """Number of runs in each state."""
    async def live(self, namespace: str, limit: int) -> int:
        """How many of ``namespace``'s runs have not ended, counted up to ``limit``."""
    async def purge(self, before: float, batch: int = 1000) -> int:
        """Delete the runs neither seen nor ended since ``before`` (ended long ago, or idle
        that long); how many."""


@runtime_checkable
class Store(Protocol):
    """A durable store: its journal and its runs, sharing one connection."""

    durability: str  # one sentence: how durable an acknowledged record is
    journal: Journal
    runs: RunRegistry
    audit: Audit

    async def open(self, *, migrate: bool = True) -> None:
        """Connect, and bring the schema up to date; ``migrate=False`` writes nothing and
        raises SchemaNotCurrent where the schema is missing or older. Permanent refusals
        raise StoreMisconfigured, everything else that is not reachable StoreUnavailable."""
    async def aclose(self) -> None: """Flush pending work and close."""
    async def ping(self) -> None: """Raise StoreUnavailable unless the store answers."""
    async def secret(self, name: str, generate: bytes) -> bytes: """Get, or set once, a named secret."""
