"""The store's domain model: journal entries and what addresses, claims and records them;
runs and their states; operator actions. Plain values, shared by every backend and by the
proxy; the rules that change them are in :mod:`.rules`.

Times are UNIX seconds (float). A journal entry is addressed by its ``kid``, a hash of
its :class:`Scope`, so tenants and runs can never collide.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

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
    """A run's state (docs/restarts.md), in the order listings show them."""
    RUNNING = "running"
    RESTARTING = "restarting"
    COMPLETED = "completed"
    FAILED = "failed"
    DEAD = "dead"


ENDED = frozenset({RunState.COMPLETED, RunState.FAILED, RunState.DEAD})
RUN_STATES = tuple(RunState)
_RUN_DEFAULTS = RunSettings()


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
    history: list[dict[str, Any]] = field(default_factory=list)  # the last rules.HISTORY_LIMIT events
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
