"""How the ``runs`` and ``journal`` commands print for people: aligned tables like
``kubectl get``, times as "3m ago", a run's or an entry's facts, its attempts' endings, its
operators' actions, the calls the proxy refused it and a quarantined call's evidence."""

from __future__ import annotations

from typing import Any

from ..evidence import decoded
from ..runs.bodies import readable
from ..store.model import EntryState, Recorded

KID_SHOWN = 12  # digits of a kid in tables: unique among millions of entries, and short


def table(header: list[str], rows: list[list[Any]]) -> str:
    """Columns padded to their widest cell, like ``kubectl get``."""
    cells = [header] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def ago(at: float | None, now: float) -> str:
    if not at:
        return "-"
    seconds = max(0.0, now - at)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.1f}s ago"


def describe(body: dict[str, Any], now: float) -> str:
    """``runs show``: the run's facts, its history, then its journal."""
    facts = [("run", body["run_id"]), ("namespace", body["namespace"]), ("state", body["state"]),
             ("epoch", body["epoch"]), ("restarts", body["restarts"]),
             ("last seen", ago(body["last_seen"], now)), ("timeout", f"{body['timeout_s']:g}s"),
             ("grace", f"{body['grace_s']:g}s"), ("max restarts", body["max_restarts"]),
             ("hook", body["hook"] or "-"), ("base url", body["base_url"])]
    width = max(len(k) for k, _ in facts)
    lines = [f"{k.ljust(width)}  {v}" for k, v in facts]
    if body["history"]:
        lines += ["", "history:", table(
            ["WHEN", "EPOCH", "EVENT", "DETAIL"],
            [[ago(e.get("at"), now), e.get("epoch"), e.get("event"),
              " ".join(f"{k}={v}" for k, v in e.items() if k not in ("at", "epoch", "event", "log_tail"))]
             for e in body["history"]])]
    lines += describe_attempts(body["attempts"], now)
    lines += describe_actions(body.get("actions", []), now, kids=True)
    lines += describe_refusals(body.get("refusals"), now)
    steps = body["steps"]
    lines += ["", f"journal ({len(steps)} entries):"]
    if steps:
        lines.append(table(
            ["#", "KID", "KEY", "UPSTREAM", "METHOD", "PATH", "STATE", "STATUS", "RECORDED", "REPLAYS", "EPOCH"],
            [[i, s["kid"][:KID_SHOWN], s["agent_key"] or "-", s["upstream"], s["method"], s["path"], s["state"],
              s["status"], ago(s["recorded_at"], now), s["replays"], s["epoch"]] for i, s in enumerate(steps, 1)]))
    return "\n".join(lines)


def describe_attempts(attempts: list[dict[str, Any]], now: float) -> list[str]:
    """``runs show``: how each attempt ended, then the last lines of the logs of those that
    have one (proxy/runs/endings.py)."""
    ended = [a for a in attempts if a["ended"] is not None]
    if not ended:
        return []
    lines = ["", "attempts:", table(
        ["EPOCH", "ENDED", "HOW", "DETAIL"],
        [[a["epoch"], ago(e["at"], now), e["how"], e["detail"] + (f"; the run is dead: {e['dead']}" if e.get("dead")
                                                                  else "")]
         for a in attempts if (e := a["ended"]) is not None]
        + [[a["epoch"], "-", "-", "the current attempt"] for a in attempts if a["ended"] is None])]
    for a in ended:
        if a["ended"].get("log_tail"):
            lines += ["", f"epoch {a['epoch']}, last lines of its log ({a['ended'].get('log', '-')}):",
                      *(f"  {line}" for line in a["ended"]["log_tail"].splitlines())]
    return lines


def describe_actions(actions: list[dict[str, Any]], now: float, kids: bool = False) -> list[str]:
    """Operator actions, oldest first (proxy/runs/operators.py): who did what, when."""
    if not actions:
        return []
    header = ["WHEN", "BY", "ACTION"] + (["KID"] if kids else []) + ["DETAIL"]
    return ["", "operator actions:", table(header, [
        [ago(a["at"], now), a["by"], a["action"]] + ([(a["kid"] or "-")[:KID_SHOWN]] if kids else [])
        + [" ".join(f"{k}={v}" for k, v in a["detail"].items() if v is not None) or "-"] for a in actions])]


def describe_refusals(refusals: dict[str, Any] | None, now: float) -> list[str]:
    """What the proxy refused the run's calls (proxy/runs/refusals.py): the last few, and how many."""
    if not refusals or not refusals["count"]:
        return []
    recent = refusals["recent"]
    shown = f", the last {len(recent)}" if refusals["count"] > len(recent) else ""
    return ["", f"refused calls ({refusals['count']}{shown}):", table(
        ["WHEN", "EPOCH", "STATUS", "TYPE", "UPSTREAM", "METHOD", "PATH", "KID"],
        [[ago(r["at"], now), r.get("epoch"), r["status"], r["type"], r["upstream"], r["method"], r["path"],
          (r.get("kid") or "-")[:KID_SHOWN]] for r in recent])]


def describe_evidence(evidence: dict[str, Any] | None) -> list[str]:
    """What a quarantined call sent, and what came back before it failed (proxy/evidence.py)."""
    if not evidence:
        return []
    lines = []
    for name, part in (("request", evidence.get("request")), ("answer", evidence.get("answer"))):
        if part is None:
            lines += ["", f"{name}: none" + (" (the upstream sent no answer)" if name == "answer" else "")]
            continue
        kept = decoded(part)
        kind, shown = readable(Recorded(part.get("status", 0), [tuple(h) for h in part["headers"]], kept))
        cut = f", the first {len(kept)} kept" if part.get("truncated") else ""
        lines += ["", f"{name} as sent" if name == "request" else f"answer: {part['status']} (before the "
                  "outcome became unknown)", *(f"  {k}: {v}" for k, v in part["headers"]),
                  f"  body ({kind}, {part['bytes']} bytes{cut}):", *(f"  {line}" for line in shown)]
    return lines


def describe_entry(body: dict[str, Any], response: Recorded | None, now: float) -> str:
    """``journal show``: the entry's facts, then its recorded response, body made readable."""
    key = f"{body['agent_key']} (the agent's Idempotency-Key)" if body["agent_key"] is not None else \
        f"{body['key']} (derived by the proxy)"
    replayed = ", ".join(f"{n} in epoch {epoch}" for epoch, (n, _) in sorted(body["replayed"].items()))
    facts = [("kid", body["kid"]), ("key", key), ("state", body["state"]), ("detail", body["detail"] or "-"),
             ("run", body["run"] or "-"), ("namespace", body["namespace"]), ("epoch", body["epoch"]),
             ("tenant", body["tenant"]), ("request", f"{body['method']} /{body['upstream']}{body['path']}"),
             ("fingerprint", body["fingerprint"]), ("created", ago(body["created_at"], now)),
             ("recorded", ago(body["recorded_at"], now)),
             ("replays", f"{body['replays']}" + (f" ({replayed})" if replayed else ""))]
    width = max(len(k) for k, _ in facts)
    lines = [f"{k.ljust(width)}  {'-' if v is None else v}" for k, v in facts]
    if body["state"] == EntryState.UNKNOWN:
        lines += ["", f"quarantined: idemproxy journal resolve {body['kid']} --retry | --status N --body TEXT"]
    elif body["state"] == EntryState.RETRIED:
        lines += ["", "retried by an operator: the next call with this key goes upstream"]
    lines += describe_evidence(body.get("evidence"))
    lines += describe_actions(body.get("actions", []), now)
    if response is not None:
        kind, shown = readable(response)
        lines += ["", f"response: {response.status}", *(f"  {k}: {v}" for k, v in response.headers),
                  "", f"body ({kind}, {len(response.body)} bytes):", *shown]
    return "\n".join(lines)
