"""A run's attempts, one after the other: which steps went live, which were replayed, where
it stopped. Built from what the store keeps, at view time:

- a step went *live* in the epoch its entry was claimed in (``Entry.epoch``), at
  ``created_at``, taking ``completed_at - created_at`` (claim to durable record);
- it was *replayed* in every epoch its replays were tallied under (``Entry.replayed``,
  counted in the background within a second of the replay, so that time is an upper bound;
  as the agent replays in journal order, so is the time of the next step: a replayed step
  shows the earlier of the two, marked ``≤``, and an attempt's times never run backwards);
- a *quarantined* step is an entry whose outcome is unknown, *in flight* one still claimed;
- an attempt starts with its history event (restart, admin-restart, attempt, revive) and
  ends where the next one starts, or with the run (completed, failed, dead); how it ended
  (its process's exit code or signal, its held connection's drop, its silence, an operator,
  the agent) is its ``ended`` event, with the last lines of its log (proxy/runs/endings.py).

Steps are in journal order (the order the calls were first made): a resumed agent asks
again in that order, so an attempt's replayed prefix comes first and its live steps follow.
Joined requests (duplicates that shared a call in flight) are not stored, so no step shows
them; ``idemproxy_requests_total{outcome="joined"}`` counts them. Refusals (409 conflict, 412
superseded epoch, 422 key reused, 502 upstream failed or outcome unknown) are no steps either:
the run keeps their count and the last few (proxy/runs/refusals.py), shown under their attempt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..runs.endings import How, endings
from ..store.model import ANSWERED_BY_OPERATOR, ENDED, Entry, EntryState, Run, RunState
from .ledger import NOTHING, Spend

STARTS = {"restart": "restarted by the supervisor", "admin-restart": "restarted by an operator",
          "attempt": "new attempt started by the agent", "revive": "revived by an operator"}
RUN_ENDED = {RunState.COMPLETED: "the run completed", RunState.FAILED: "the run failed",
             RunState.DEAD: "the run is dead"}
OUTCOMES = {EntryState.COMPLETE: "live", EntryState.UNKNOWN: "quarantined",
            EntryState.IN_FLIGHT: "in flight", EntryState.UNRECORDABLE: "live, not kept",
            EntryState.RETRIED: "retried by an operator"}
# an entry an operator answered: its answer and its time are the operator's, not the upstream's
ANSWERED = "answered by an operator"


@dataclass(slots=True)
class Step:
    entry: Entry
    outcome: str  # live, replayed, quarantined, in flight, live, not kept
    at: float
    latency_s: float | None
    spend: Spend
    replays_here: int = 0  # a live step replayed in its own attempt (the agent retried its key)
    at_most: bool = False  # ``at`` is an upper bound (a replay's time, see the module's docstring)


@dataclass(slots=True)
class Attempt:
    epoch: int | None  # None: calls that named no epoch
    started_at: float
    how: str  # how it began
    steps: list[Step] = field(default_factory=list)
    events: list[tuple[int, dict[str, Any]]] = field(default_factory=list)  # (index in history, event)
    ended: str | None = None  # how it ended; None while it is the run's live attempt
    cut_short: bool = False  # it stopped before the run's work was done: its last step is where
    ending: dict[str, Any] | None = None  # its ``ended`` event (proxy/runs/endings.py), where recorded

    def count(self, outcome: str) -> int:
        return sum(1 for s in self.steps if s.outcome == outcome)


def attempts(run: Run, entries: list[Entry], spends: dict[str, Spend]) -> list[Attempt]:
    """The run's attempts, oldest first, each with its steps and its history events."""
    found: dict[int | None, Attempt] = {0: Attempt(0, run.created_at, "first attempt")}
    for i, event in enumerate(run.history):
        epoch = event.get("epoch")
        if event.get("event") in STARTS and isinstance(epoch, int):
            found[epoch] = Attempt(epoch, event.get("at", 0.0), STARTS[event["event"]])
    if run.epoch not in found:  # raised by a request's Idem-Epoch, with no event of its own
        found[run.epoch] = Attempt(run.epoch, run.started_at, "started by the agent's epoch")
    for entry in entries:
        if entry.epoch not in found:
            found[entry.epoch] = Attempt(entry.epoch, entry.created_at,
                                         "calls without an epoch" if entry.epoch is None else "started by the agent")
        for epoch in entry.replayed:
            if epoch not in found:
                found[epoch] = Attempt(epoch, entry.replayed[epoch][1], "started by the agent")
    for i, event in enumerate(run.history):
        attempt = found.get(event.get("epoch"))
        if attempt is not None and event.get("event") not in STARTS:
            attempt.events.append((i, event))
    for entry in entries:
        _place(found, entry, spends.get(entry.kid, NOTHING))
    ordered = sorted(found.values(), key=lambda a: (a.epoch is None, a.epoch or 0))
    _ends(run, ordered)
    return ordered


def _place(found: dict[int | None, Attempt], entry: Entry, spent: Spend) -> None:
    latency = entry.completed_at - entry.created_at if entry.completed_at else None
    own = entry.replayed.get(entry.epoch, (0, 0.0))[0] if entry.epoch is not None else 0
    outcome = OUTCOMES.get(entry.state, entry.state)
    if entry.state == EntryState.COMPLETE and entry.detail == ANSWERED_BY_OPERATOR:
        outcome, latency = ANSWERED, None
    found[entry.epoch].steps.append(Step(entry, outcome, entry.created_at, latency, spent, own))
    for epoch, (_, first_seen) in entry.replayed.items():
        if epoch != entry.epoch:
            found[epoch].steps.append(Step(entry, "replayed", first_seen, None, spent))


def _bound_replay_times(steps: list[Step]) -> None:
    """A replayed step happened before the step after it: its time is at most that one's."""
    later = None
    for step in reversed(steps):
        if step.outcome == "replayed":
            step.at_most = True
            if later is not None and later < step.at:
                step.at = later
        later = step.at


def _ends(run: Run, ordered: list[Attempt]) -> None:
    numbered = [a for a in ordered if a.epoch is not None]
    for attempt, following in zip(numbered, numbered[1:]):
        attempt.ended = f"superseded: epoch {following.epoch} {following.how}"
        attempt.cut_short = True
    for attempt in ordered:
        attempt.steps.sort(key=lambda s: s.entry.created_at)
        _bound_replay_times(attempt.steps)
    if run.state in ENDED and numbered:
        numbered[-1].ended = RUN_ENDED[run.state]
        numbered[-1].cut_short = run.state == RunState.DEAD
    recorded = endings(run.history)
    for attempt, following in zip(numbered, numbered[1:] + [None]):
        ending = attempt.ending = recorded.get(attempt.epoch)
        if ending is None:
            continue
        attempt.ended = ending.get("detail") or ending.get("how")
        if ending.get("dead"):
            attempt.ended += f"; the run is dead: {ending['dead']}"
        attempt.cut_short = ending.get("how") not in (How.COMPLETED, How.FAILED)
        if following is not None and following.how == STARTS["restart"]:  # why the supervisor did
            following.how += f": epoch {attempt.epoch} {attempt.ended}"
