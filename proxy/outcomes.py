"""What the proxy did with a request: the ``outcome`` label of ``idemproxy_requests``
(docs/operations.md) and the fifth field of an access-log line."""

from __future__ import annotations

from enum import StrEnum


class Outcome(StrEnum):
    RECORDED = "recorded"          # claimed, forwarded, recorded (or tried to: see the upstream's answer)
    REPLAYED = "replayed"          # answered from the journal; the upstream was not asked
    JOINED = "joined"              # a duplicate that got the first call's answer, or joined its stream
    PASSTHROUGH = "passthrough"    # forwarded, nothing recorded
    CONFLICT = "conflict"          # key-reused, in-flight, outcome-unknown, not-replayable
    FENCED = "fenced"              # a superseded attempt (stale-epoch)
    REJECTED = "rejected"          # refused before anything else happened
    DISCONNECTED = "disconnected"  # the agent went away before its answer
