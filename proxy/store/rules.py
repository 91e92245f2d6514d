"""The rules every backend applies alike, written once: how a run moves to its next
attempt and what its history keeps; what derived keys' occurrences and replays are counted
by; the buckets events are counted in. Backends that change a run inside the store (Lua,
SQL) keep to the same rules; the contract suite holds them to it.
"""

from __future__ import annotations

from typing import Any

from .model import Run, RunState

HISTORY_LIMIT = 50  # a run keeps its last 50 events

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



# Events are counted in EVENT_BUCKETS buckets per window: a window read back is the buckets it
# overlaps, so it may reach up to one bucket further back than ``window_s`` (never less far).
EVENT_BUCKETS = 6


def event_bucket(window_s: float, now: float) -> tuple[int, float]:
    """(the number of the bucket ``now`` falls in, that bucket's size) for a window."""
    size = window_s / EVENT_BUCKETS
    return int(now // size), size
