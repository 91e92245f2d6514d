"""A run and its journal as the runs API, the admin API and ``idemproxy runs --json`` show them."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from ..store.model import Entry, Run, Scope
from .endings import endings


def run_json(run: Run, proxy_url: str, *, history: bool = False, tails: bool = True,
             token: str | None = None) -> dict[str, Any]:
    """A run. ``history`` (hook errors, pids, log paths, how each attempt ended) is for
    operators only; without ``tails``, the last lines of attempts' logs are left out.
    ``token``, the run's capability, is for the run's own agents only: its ``base_url`` binds
    the attempt's traffic to the run whatever credential each call carries."""
    body = {"run_id": run.run_id, "namespace": run.namespace, "state": run.state, "epoch": run.epoch,
            "restarts": run.restarts, "last_seen": run.last_seen, "started_at": run.started_at,
            "timeout_s": run.timeout_s, "grace_s": run.grace_s, "max_restarts": run.max_restarts,
            "hook": run.hook, "metadata": run.metadata, "created_at": run.created_at,
            "ended_at": run.ended_at, "next_restart_at": run.next_restart_at,
            "base_url": f"{proxy_url}/runs/{run.run_id}/epochs/{run.epoch}"}
    if token is not None:
        body["token"] = token
        body["base_url"] += f"/cap/{token}"
    if history:
        body["history"] = run.history if tails else [_without_tail(e) for e in run.history]
        body["attempts"] = attempts_json(run, tails)
    return body


def attempts_json(run: Run, tails: bool = True) -> list[dict[str, Any]]:
    """Each attempt that ended, and the current one, oldest first: ``{"epoch": e, "ended":
    {"at", "how", "detail", ...} or None}`` (proxy/runs/endings.py)."""
    ended = endings(run.history)
    return [{"epoch": epoch, "ended": None if epoch not in ended else
             {k: v for k, v in (ended[epoch] if tails else _without_tail(ended[epoch])).items()
              if k not in ("epoch", "event")}}
            for epoch in sorted(ended.keys() | {run.epoch})]


def _without_tail(event: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in event.items() if k != "log_tail"} if "log_tail" in event else event


def step_json(entry: Entry) -> dict[str, Any]:
    """A journal entry of a run: metadata, no body. ``key`` is the agent's own
    Idempotency-Key as it sent it (see ``Scope.of_key``), or the key the proxy derived;
    ``agent_key`` is the agent's own or None. ``replayed``: {epoch: [replays, first seen]}."""
    return {"key": entry.key.removeprefix("key:"), "agent_key": agent_key(entry), "kid": entry.kid,
            "upstream": entry.upstream, "method": entry.method, "path": entry.path, "state": entry.state,
            "status": entry.response.status if entry.response else None,
            "created_at": entry.created_at, "recorded_at": entry.completed_at,
            "replays": entry.replays, "replayed": {str(e): list(t) for e, t in entry.replayed.items()},
            "epoch": entry.epoch, "detail": entry.detail}


def agent_key(entry: Entry) -> str | None:
    """The ``Idempotency-Key`` the agent sent, or None where the proxy derived the key."""
    prefix = Scope.agent_key("")
    return entry.key[len(prefix):] if entry.key.startswith(prefix) else None


def entry_json(entry: Entry) -> dict[str, Any]:
    """A journal entry wherever it lives (``journal list|show|find``): a step, and whose."""
    return {**step_json(entry), "tenant": entry.tenant, "namespace": entry.namespace, "run": entry.run,
            "fingerprint": entry.fingerprint}


def listing_json(runs: list[Run], steps: dict[tuple[str, str], int], proxy_url: str) -> dict[str, Any]:
    """``GET /admin/runs``: each run with its number of journal entries as ``steps`` (the last
    lines of its attempts' logs only in the run's own view)."""
    return {"runs": [{**run_json(r, proxy_url, history=True, tails=False),
                      "steps": steps.get((r.namespace, r.run_id), 0)} for r in runs]}


def iso_times(body: Any) -> Any:
    """``body`` with its times (``*_at``, ``last_seen``: Unix seconds, as the APIs answer them)
    as ISO 8601 in UTC, for people reading ``--json`` output."""
    if isinstance(body, list):
        return [iso_times(item) for item in body]
    if not isinstance(body, dict):
        return body
    return {key: _iso(value) if _is_time(key, value) else iso_times(value) for key, value in body.items()}


def _is_time(key: str, value: Any) -> bool:
    return (key.endswith("_at") or key in ("at", "last_seen")) and isinstance(value, (int, float)) \
        and not isinstance(value, bool)


def _iso(at: float) -> str:
    return datetime.fromtimestamp(at, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
