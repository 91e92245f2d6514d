"""The store's hot path: the calls an agent's requests make, the request path's journal
(claim, record, replay, join a stream) and the run-scoped paths' runs (epochs, heartbeats,
ends, held connections). Every backend implements them with as few round trips as it can;
what operators and the supervisor call is in :mod:`.administration`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from .model import Claim, ClaimResult, Entry, Recorded, Run


@runtime_checkable
class JournalPath(Protocol):
    """The request path's journal: entries claimed, completed or quarantined, replayed (docs/concepts.md)."""

    async def get(self, kid: str) -> Entry | None: """The live entry, with its response."""
    async def claim(self, claim: Claim) -> ClaimResult:
        """Own ``claim.scope`` unless taken; a taken key is answered with its live entry (the
        proxy asks nothing else first: a new key costs two store calls, claim and complete)."""
    async def next_occurrence(self, namespace: str, run: str, epoch: int | None, fingerprint: str,
                              retention_s: float, *, tenant: str) -> int:
        """Count of earlier calls alike in the run's epoch by ``tenant`` (see :func:`.rules.counted`)."""
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
    async def append_partial(self, kid: str, owner: str, seq: int, data: bytes) -> None:
        """Bytes of a stream still in flight, so other proxies can join it."""
    async def read_partial(self, kid: str, after_seq: int) -> list[tuple[int, bytes]]: ...
    async def wait(self, kid: str, timeout: float) -> None:
        """Return when ``kid`` may have changed (or after ``timeout``)."""
    async def count_replays(self, counts: dict[str, int]) -> None:
        """Add replay counts, each also tallied in ``Entry.replayed`` under the current epoch of
        the entry's run (an entry without a run only counts)."""
    async def generation(self) -> int:
        """The journal's invalidation generation: 0 at first, raised by every change to complete
        entries other than their expiry (``delete_run``; a resolve changes quarantined entries
        only). Entries held in memory answer only under the generation they were read in
        (proxy/freshness.py). Raised in the same transaction as the change, never before it:
        a read that sees the new generation then also sees the change."""


@runtime_checkable
class RunsPath(Protocol):
    """Runs as agents' requests move them: epochs, heartbeats, ends, held connections (docs/restarts.md)."""

    async def observe_epoch(self, namespace: str, run_id: str, epoch: int | None, defaults: Run,
                            now: float, ended: dict[str, Any] | None = None) -> int:
        """Create the run if new (from ``defaults``, at ``epoch`` or 0); raise its epoch to
        ``epoch`` when that is the next one (current + 1), remembering ``ended`` as how the
        attempt before ended (:func:`.rules.ending_event`) in the same change; return the epoch
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
    async def attach(self, namespace: str, run_id: str, epoch: int) -> Run | None:
        """Count a held connection of attempt ``epoch`` (``attachments`` + 1), unless the run
        has ended, is at another epoch or that attempt is lost (then nothing changes). The run
        afterwards; None if there is none."""
    async def lose(self, namespace: str, run_id: str, epoch: int, now: float, event: dict[str, Any],
                   attachment: int | None = None) -> bool:
        """Mark attempt ``epoch`` lost and remember ``event``: only while the run is at that
        epoch and not ended, and with ``attachment``, only if no connection was held after
        that one. True if marked (and the bell rung for every supervisor)."""
