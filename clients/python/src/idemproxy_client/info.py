"""A run as the proxy reports it (the run JSON of the runs API)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # the client supports 3.10, which lacks StrEnum: members are their value as str
    class StrEnum(str, Enum):
        def __str__(self) -> str:
            return str(self.value)


class RunState(StrEnum):
    """A run's state; each member equals the string the proxy sends (``"running"``, …)."""

    RUNNING = "running"
    RESTARTING = "restarting"  # the supervisor is starting a new attempt
    COMPLETED = "completed"
    FAILED = "failed"
    DEAD = "dead"  # given up: out of restarts, or silent with no hook to start it again

    @property
    def ended(self) -> bool:
        """Completed, failed or dead: the run takes no new attempt."""
        return self in (RunState.COMPLETED, RunState.FAILED, RunState.DEAD)


@dataclass(frozen=True)
class RunInfo:
    """One snapshot of a run. Times are UNIX seconds; ``raw`` keeps every member sent."""

    run_id: str
    state: RunState
    epoch: int
    namespace: str = "default"
    restarts: int = 0
    last_seen: float = 0.0
    started_at: float = 0.0
    timeout_s: float = 60.0
    grace_s: float = 30.0
    max_restarts: int = 0
    hook: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    created_at: float = 0.0
    ended_at: float | None = None
    base_url: str | None = None
    token: str | None = field(default=None, repr=False)  # the run's capability (a credential)
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @property
    def ended(self) -> bool:
        """Completed, failed or dead: the run takes no new attempt."""
        return self.state.ended

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> RunInfo:
        """Parse the run JSON; members this client does not know are kept in ``raw``."""
        ended_at = body.get("ended_at")
        return cls(
            run_id=str(body["run_id"]),
            state=RunState(body.get("state", RunState.RUNNING)),
            epoch=int(body.get("epoch", 0)),
            namespace=str(body.get("namespace", "default")),
            restarts=int(body.get("restarts", 0)),
            last_seen=float(body.get("last_seen") or 0.0),
            started_at=float(body.get("started_at") or 0.0),
            timeout_s=float(body.get("timeout_s") or 60.0),
            grace_s=float(body.get("grace_s") or 0.0),
            max_restarts=int(body.get("max_restarts") or 0),
            hook=body.get("hook"),
            metadata=dict(body.get("metadata") or {}),
            created_at=float(body.get("created_at") or 0.0),
            ended_at=float(ended_at) if ended_at is not None else None,
            base_url=body.get("base_url"),
            token=body.get("token"),
            raw=dict(body),
        )
