"""The store's administration: what operators, the console and the supervisor call. Scans
are allowed here (``search``, ``kids``); the request path never waits on them. The calls
an agent's requests make are in :mod:`.hot_path`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from .model import Action, Entry, Recorded, Run
from .rules import SILENT_LIMIT


@runtime_checkable
class JournalAdmin(Protocol):
    """The journal as operators see it: decided, searched, counted, deleted, purged."""

    async def resolve(self, kid: str, recorded: Recorded | None) -> bool:
        """Operator decision on an unknown key: None = retry (the entry stays, ``retried``, until
        the next claim of its key takes it over), else the answer to replay."""
    async def purge(self, now: float, batch: int = 1000) -> int: """Delete expired entries."""
    async def entries(self, namespace: str, run: str) -> list[Entry]:
        """A run's entries (every tenant's), oldest first, with status but no body."""
    async def delete_run(self, namespace: str, run: str) -> int:
        """Delete a run's entries, and raise the generation in the same transaction."""
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
class RunsAdmin(Protocol):
    """Runs as operators and the supervisor see them: registered, listed, restarted, revived."""

    async def upsert(self, run: Run) -> Run: """Create, or update timeouts/hook/metadata."""
    async def find(self, namespace: str | None, run_id: str) -> list[Run]:
        """The run in ``namespace``; with None, the runs of that id in every namespace."""
    async def list(self, state: str | None = None, limit: int = 1000) -> list[Run]: ...
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
    async def wait_lost(self, timeout: float) -> bool:
        """True when an attempt was marked lost since the last call, False after ``timeout``."""
    async def revive(self, namespace: str, run_id: str, now: float) -> Run | None:
        """A dead run's next attempt (see :func:`.rules.revive_attempt`); None unless the run is dead."""
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
