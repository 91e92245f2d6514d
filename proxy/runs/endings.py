"""How an attempt ended (docs/restarts.md), kept in the run's history.

Whatever ends an attempt records one ``ended`` event for it, in the same store change that
ends it (a new attempt, or the run's end)::

    {"at": ..., "epoch": 1, "event": "ended", "how": "exited", "detail": "exited with code 1",
     "code": 1, "signal": null, "log": "logs/default.r.1.log", "log_tail": "...last lines..."}

``how`` is one of :class:`How`; ``detail`` says it in words, the same ones in the console,
``idemproxy runs show`` and the admin API. Where the attempt was started by a command hook,
the last lines of its log go with it (at most TAIL_LINES lines and TAIL_BYTES bytes), read
when the process exited (by the supervisor that watched it), or when the attempt ended, by
whoever ended it, where that log can be read.
"""

from __future__ import annotations

import asyncio
import os
from enum import StrEnum
from typing import Any

from ..store.model import Run

ENDED = "ended"  # the history event
TAIL_LINES, TAIL_BYTES = 20, 4096


class How(StrEnum):
    """How an attempt ended."""
    EXITED = "exited"          # its hook-started process exited (with a code)
    KILLED = "killed"          # its hook-started process was killed by a signal
    DROPPED = "dropped"        # its held connection (POST /runs/{id}/attach) stayed gone
    SILENT = "silent"          # no request open and no byte for timeout_s: the supervisor restarted it
    OPERATOR = "operator"      # an operator restarted the run (admin API, CLI, console)
    COMPLETED = "completed"    # the run was completed (by the agent, or an operator)
    FAILED = "failed"          # the run was failed (by the agent)
    SUPERSEDED = "superseded"  # the agent started a new attempt (POST /runs/{id}/attempts, or a
                               # request carrying the next Idem-Epoch)


def log_tail(path: str | os.PathLike | None) -> str | None:
    """The last TAIL_LINES lines of the file at ``path``, within its last TAIL_BYTES bytes
    (a line cut by that bound is left out); None if there is no such file or nothing in it."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - TAIL_BYTES))
            data = f.read(TAIL_BYTES)
    except OSError:
        return None
    lines = data.decode("utf-8", errors="replace").splitlines()
    if size > TAIL_BYTES and lines:
        lines = lines[1:]  # begun mid-line
    return "\n".join(lines[-TAIL_LINES:]) or None


def exit_ending(facts: dict[str, Any]) -> dict[str, Any]:
    """The ending of an attempt whose process exited: from its ``hook-exit`` event's facts."""
    code, sig = facts.get("code"), facts.get("signal")
    if sig:
        ending = {"how": How.KILLED, "detail": f"killed by {sig}"}
    else:
        ending = {"how": How.EXITED, "detail": "exited" if code is None else f"exited with code {code}"}
    ending.update(code=code, signal=sig)
    return _with_log(ending, facts)


def lost_ending(run: Run) -> dict[str, Any] | None:
    """How the run's current attempt was found lost (its process exited, its held connection
    stayed gone), from the event that marked it; None unless it is lost."""
    if not run.lost:
        return None
    found = next((e for e in reversed(run.history) if e.get("epoch") == run.epoch
                  and (e.get("event") == "attachment-lost" or e.get("event") == "hook-exit" and e.get("lost"))),
                 None)
    if found is None:  # pushed out of the history meanwhile
        return {"how": How.EXITED, "detail": "found lost"}
    if found["event"] == "hook-exit":
        return exit_ending(found)
    waited = found.get("waited_s")
    detail = "its held connection closed" + (" and its process exited" if found.get("process") == "exited"
                                             else f" and stayed gone for {waited:g}s" if waited is not None else "")
    return {"how": How.DROPPED, "detail": detail, "waited_s": waited}


def silent_ending(run: Run, now: float) -> dict[str, Any]:
    silent = round(max(0.0, now - run.last_seen), 3)
    return {"how": How.SILENT, "detail": f"silent for {silent:g}s (timeout_s {run.timeout_s:g}): no request "
            "open, no byte moved", "silent_s": silent, "timeout_s": run.timeout_s}


def supervisor_ending(run: Run, now: float) -> dict[str, Any]:
    """Why the supervisor takes the run's current attempt for over: found lost, or silent."""
    return lost_ending(run) or silent_ending(run, now)


def operator_ending(by: str | None = None) -> dict[str, Any]:
    """An operator restarted the run; ``by`` names them where known."""
    by = by or "operator"
    return {"how": How.OPERATOR, "detail": f"restarted by {_who(by)}", "by": by}


def end_ending(state: str, by: str | None = None) -> dict[str, Any]:
    """The run was completed or failed: by the agent unless ``by`` says who ("operator")."""
    by = by or "agent"
    return {"how": How(state), "detail": f"{state} by {_who(by)}", "by": by}


def _who(by: str) -> str:
    return {"agent": "the agent", "operator": "an operator"}.get(by, by)


def superseded_ending(by_request: int | None = None) -> dict[str, Any]:
    """The agent started the next attempt: through ``POST /runs/{id}/attempts``, or by a
    request carrying the next attempt's epoch (``by_request``, that epoch)."""
    if by_request is None:
        return {"how": How.SUPERSEDED, "detail": "the agent started the next attempt"}
    return {"how": How.SUPERSEDED, "detail": f"a request of epoch {by_request} started the next attempt",
            "by_request": by_request}


async def with_log_tail(run: Run, ending: dict[str, Any]) -> dict[str, Any]:
    """``ending`` with the current attempt's log and its tail, where a command hook started
    the attempt and its log is readable here (the supervisor that started it runs here)."""
    if "log_tail" in ending:
        return ending
    started = next((e for e in reversed(run.history)
                    if e.get("event") == "hook-started" and e.get("epoch") == run.epoch), None)
    if started is None or not started.get("log"):
        return ending
    tail = await asyncio.to_thread(log_tail, started["log"])
    return {**ending, "log": started["log"], "log_tail": tail}


def _with_log(ending: dict[str, Any], facts: dict[str, Any]) -> dict[str, Any]:
    for name in ("log", "log_tail"):
        if facts.get(name) is not None:
            ending[name] = facts[name]
    return ending


def endings(history: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """How each attempt ended, by epoch, from a run's history."""
    return {e["epoch"]: e for e in history if e.get("event") == ENDED and isinstance(e.get("epoch"), int)}
