"""What a campaign saw, and the invariants it checks at the end.

Facts come from three places that do not trust each other: the agents' event files (every
answer they saw, byte for byte), the upstream's ledger (every call that reached it), and the
store, through the admin API (every run's state). Then every logical call an agent got an
answer for is asked once more, through the proxies, and must come back as a replay of the
very bytes the agent saw.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from .ledger import Delivery

Call = tuple[str, int, str]  # (run, step, kind): one logical call


@dataclass
class Report:
    backend: str
    seed: int
    fault_seconds: float
    seconds: float = 0.0  # the whole campaign, from the first process started to the verdict
    faults: dict[str, int] = field(default_factory=dict)
    fault_log: list[dict] = field(default_factory=list)  # every fault: when, what, how long down
    # processes that exited while starting (the store went away under them), started again
    failed_starts: dict[str, int] = field(default_factory=dict)
    runs: dict[str, int] = field(default_factory=dict)  # registered, completed, attempts, restarts
    calls: dict[str, int] = field(default_factory=dict)  # what agents sent and what they got
    upstream: dict[str, int] = field(default_factory=dict)  # what reached the ledger
    # the invariants: each must be 0 / empty
    duplicates: int = 0  # a tool step executed more than once
    missing: int = 0  # a step of a completed run that never reached the upstream
    forwarded_after_answer: int = 0  # deliveries after an agent had seen the step's answer
    records_lost: int = 0  # answers seen that do not replay byte for byte
    forwarded_on_reask: int = 0
    stuck: list[dict] = field(default_factory=list)  # runs not completed, or registered and gone
    anomalies: list[dict] = field(default_factory=list)  # answers no correct proxy gives
    examples: dict[str, list] = field(default_factory=dict)  # a few offenders per invariant

    def broken(self) -> dict[str, int]:
        """The invariants that do not hold, each with its count of offenders: {} when all hold."""
        counts = {"duplicates": self.duplicates, "missing": self.missing,
                  "forwarded_after_answer": self.forwarded_after_answer, "records_lost": self.records_lost,
                  "forwarded_on_reask": self.forwarded_on_reask, "stuck": len(self.stuck),
                  "anomalies": len(self.anomalies)}
        return {name: n for name, n in counts.items() if n}

    def as_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    def table(self) -> str:
        rows = [("store", self.backend), ("seed", self.seed), ("fault window (s)", self.fault_seconds),
                ("campaign (s)", round(self.seconds, 1)),
                ("faults injected", ", ".join(f"{k} {v}" for k, v in self.faults.items())),
                ("exited while starting, started again",
                 ", ".join(f"{k} {v}" for k, v in self.failed_starts.items() if v) or "none"),
                *((f"runs {k}", v) for k, v in self.runs.items()),
                *((f"calls {k}", v) for k, v in self.calls.items()),
                *((f"upstream {k}", v) for k, v in self.upstream.items()),
                ("duplicates", self.duplicates), ("missing side effects", self.missing),
                ("forwarded after an answer was seen", self.forwarded_after_answer),
                ("records lost", self.records_lost), ("forwarded on re-ask", self.forwarded_on_reask),
                ("runs lost or stuck", len(self.stuck)), ("anomalies", len(self.anomalies))]
        width = max(len(str(name)) for name, _ in rows)
        return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def read_events(folder: Path) -> list[dict]:
    events = []
    for path in sorted((folder / "events").iterdir()):
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # the last line of an agent killed while writing it
    return events


def crashes(folder: Path) -> list[dict]:
    """Agents that died of an exception (a SIGKILL leaves no traceback): an answer the agent
    could not read is as wrong as a refusal a correct proxy never gives."""
    logs = [*(folder / "agent-logs").iterdir(), *(folder / "hook-logs").glob("*.log")]
    return [{"crash": path.name, "tail": text[-600:]} for path in sorted(logs)
            if "Traceback" in (text := path.read_text(errors="replace"))]


def count_calls(report: Report, events: list[dict]) -> dict[Call, list[dict]]:
    """The agents' side: answers by logical call, and the figures of what they sent."""
    answers: dict[Call, list[dict]] = collections.defaultdict(list)
    errors = collections.Counter()
    anomalies = [ev for ev in events if ev["ev"] == "anomaly"]
    for ev in events:
        if ev["ev"] == "answer":
            answers[(ev["run"], ev["step"], ev["kind"])].append(ev)
        elif ev["ev"] == "error":
            errors[ev.get("slug") or ev["what"]] += 1
    seen = [ev for evs in answers.values() for ev in evs]
    fenced = sum(ev["ev"] == "superseded" for ev in events)
    report.anomalies += anomalies
    report.calls = {"sent": len(seen) + sum(errors.values()) + fenced + len(anomalies),
                    "answered": len(seen), "answered as replays": sum(ev["replayed"] == "true" for ev in seen),
                    "refused as a superseded attempt (412)": fenced,
                    **{f"retried after {what}": n for what, n in sorted(errors.items())}}
    report.runs["attempts"] = len({(ev["run"], ev["epoch"]) for ev in events if ev["ev"] in ("start", "attempt")})
    return answers


def check_ledger(report: Report, deliveries: list[Delivery], answers: dict[Call, list[dict]],
                 completed: set[str], steps: int) -> None:
    """Exactly one side effect per tool step, none forwarded once an answer was seen, and
    every step of every completed run done upstream."""
    by_call: dict[Call, list[Delivery]] = collections.defaultdict(list)
    for d in deliveries:
        by_call[(d.run, d.step, d.kind)].append(d)
    tools = [ds for (_, _, kind), ds in by_call.items() if kind == "tool"]
    chats = [ds for (_, _, kind), ds in by_call.items() if kind == "chat"]
    executed = {call: sum(d.executed for d in ds) for call, ds in by_call.items()}
    report.upstream = {
        "model calls": sum(len(ds) for ds in chats),
        "model calls made again (the first answer never recorded)": sum(len(ds) - 1 for ds in chats),
        "tool calls": sum(len(ds) for ds in tools),
        "tool side effects": sum(sum(d.executed for d in ds) for ds in tools),
        "tool repeats absorbed by the forwarded key": sum(sum(not d.executed for d in ds) for ds in tools)}
    dup = [c for c, n in executed.items() if c[2] == "tool" and n > 1]
    report.duplicates = sum(executed[c] - 1 for c in dup)
    late = [(c, d.t - min(ev["t"] for ev in answers[c])) for c, ds in by_call.items() if c in answers
            for d in ds if d.t > min(ev["t"] for ev in answers[c])]
    report.forwarded_after_answer = len(late)
    missing = [(run, step, kind) for run in sorted(completed) for step in range(1, steps + 1)
               for kind in ("chat", "tool") if not executed.get((run, step, kind))]
    report.missing = len(missing)
    report.examples.update(duplicates=dup[:5], forwarded_after_answer=late[:5], missing=missing[:5])


async def reask_all(report: Report, session: aiohttp.ClientSession, proxies: list[str],
                    answers: dict[Call, list[dict]], ledger_count) -> None:
    """Ask every answered call once more and compare with every answer an agent saw for it."""
    before = ledger_count()
    limit = asyncio.Semaphore(8)
    lost = []

    async def one(i: int, call: Call, seen: list[dict]) -> None:
        first = seen[0]
        headers = {"Authorization": f"Bearer sk-campaign-{first['run']}", "Content-Type": "application/json"}
        if first["key"]:
            headers["Idempotency-Key"] = first["key"]
        # no epoch: never fenced; a derived key counts from 0 in the epoch-less bucket, and each
        # call's body is unique in its run, so this is occurrence 0, the call the agents made
        url = f"{proxies[i % len(proxies)]}/runs/{first['run']}{first['path']}"
        async with limit, session.post(url, data=first["body"].encode(), headers=headers) as r:
            body, replayed, status = await r.read(), r.headers.get("Idempotent-Replayed"), r.status
        wrong = [ev["epoch"] for ev in seen if base64.b64decode(ev["answer"]) != body]
        if status != 200 or replayed != "true" or wrong:
            lost.append({"call": call, "status": status, "replayed": replayed, "differs_from_epochs": wrong,
                         "body": body[:300].decode(errors="replace")})

    await asyncio.gather(*(one(i, call, seen) for i, (call, seen) in enumerate(sorted(answers.items()))))
    report.records_lost = len(lost)
    report.calls["re-asked after the campaign"] = len(answers)
    report.forwarded_on_reask = ledger_count() - before
    report.examples["records_lost"] = lost[:5]


def check_runs(report: Report, registered: set[str], runs: list[dict]) -> set[str]:
    """Every run registered is in the store, completed; the completed ones."""
    by_id = {r["run_id"]: r for r in runs}
    completed = {r["run_id"] for r in runs if r["state"] == "completed"}
    for run_id in sorted(registered | set(by_id)):
        run = by_id.get(run_id)
        if run is None or run["state"] != "completed":
            report.stuck.append({"run": run_id, "state": run and run["state"], "epoch": run and run["epoch"],
                                 "restarts": run and run["restarts"],
                                 "history": run and run.get("history", [])[-8:]})
    report.runs.update(registered=len(registered), completed=len(completed),
                       restarts=sum(r["restarts"] for r in runs))
    return completed
