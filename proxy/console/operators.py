"""What the console shows of operators' work: a quarantined call's evidence, made readable
(proxy/evidence.py), and the audit of operator actions (proxy/runs/operators.py)."""

from __future__ import annotations

from typing import Any

from ..evidence import decoded
from ..runs.bodies import readable
from ..store.base import Recorded


def evidence_parts(evidence: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The request and the answer as the entry page lists them: a title, headers (credentials
    already masked), the body's kind and lines, and how much of it was kept."""
    parts = []
    for name in ("request", "answer"):
        part = (evidence or {}).get(name)
        if part is None:
            continue
        kept = decoded(part)
        kind, lines = readable(Recorded(part.get("status", 0), [tuple(h) for h in part["headers"]], kept))
        parts.append({"name": name, "status": part.get("status"), "headers": part["headers"], "kind": kind,
                      "lines": lines, "bytes": part["bytes"], "kept": len(kept), "truncated": part["truncated"]})
    return parts
