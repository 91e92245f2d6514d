"""What the console shows of operators' work: a quarantined call's evidence, made readable
(proxy/evidence.py), and the audit of operator actions (proxy/runs/operators.py)."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from ..evidence import decoded
from ..runs.bodies import readable
from ..problems import Problem
from ..store.model import Entry, Recorded

PREVIEW_CHARS = 160  # of a body, on the quarantine page
PREVIEWED = 100  # quarantined entries whose evidence the quarantine page reads


async def previews(service, entries: list[Entry]) -> dict[str, dict[str, Any]]:
    """What the newest quarantined calls sent and got, in a line each, by kid: listings read no
    evidence, so each entry is read (the first PREVIEWED, at once)."""
    async def one(entry: Entry) -> Entry | None:
        try:
            return await service.entry(entry.kid)
        except Problem:  # resolved or expired meanwhile
            return None
    full = await asyncio.gather(*(one(e) for e in entries[:PREVIEWED]))
    return {e.kid: preview(e.evidence) for e in full if e is not None and e.evidence}


def preview(evidence: dict[str, Any]) -> dict[str, Any]:
    """{"sent": the request's body, "status": the answer's status or None, "got": its body}, each
    body as one line of text, cut at PREVIEW_CHARS."""
    answer = evidence.get("answer")
    return {"sent": _line(decoded(evidence.get("request"))), "status": answer["status"] if answer else None,
            "got": _line(decoded(answer)) if answer else ""}


def _line(body: bytes) -> str:
    text = re.sub(r"\s+", " ", body.decode("utf-8", errors="replace")).strip()
    return text if len(text) <= PREVIEW_CHARS else text[:PREVIEW_CHARS] + "…"


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
