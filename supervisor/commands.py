"""The supervisor's commands: ``supervise``, ``runs list|show|restart|revive|complete``,
``journal list|show|find|resolve``.

They talk to the store named by the same configuration as ``serve`` (``--config``,
``--store``, ``IDEMPROXY_*``), print aligned tables for people and JSON with ``--json``.
Tables show a kid's first KID_SHOWN digits; ``journal show`` and ``resolve`` take any unique
start of one. Only ``supervise`` migrates the store's schema. Exit codes: 0 done, 1 refused
(not found, already ended, not quarantined) or the store failed, 2 a bad command line.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import signal
import sys
import time
from typing import Any, Awaitable, Callable

import orjson

from ..proxy.evidence import decoded
from ..proxy.store import open_store
from ..proxy.config import Settings
from ..proxy.problems import Problem
from ..proxy.runs import RunsService
from ..proxy.runs.bodies import readable
from ..proxy.runs.operators import cli_operator
from ..proxy.runs.options import JOURNAL_STATES, journal_state, resolution
from ..proxy.runs.views import agent_key, entry_json, iso_times, listing_json, run_json, step_json
from ..proxy.eventloop import run
from ..proxy.store.base import RUN_STATES, Entry, EntryState, Recorded, Run, RunState
from .hooks import Hooks
from .loop import Supervisor


def add_commands(sub, common: argparse.ArgumentParser) -> None:
    """Add our commands to the ``idemproxy`` parser (called by the composition root)."""
    supervise = sub.add_parser(
        "supervise", parents=[common], help="run the supervisor alone against the store (no proxy)",
        description="Run the supervisor alone against the store, for deployments that run it apart from "
        "the proxies: it brings the store's schema up to date, then restarts silent runs by their hooks.")
    supervise.set_defaults(handler=cmd_supervise)

    runs = sub.add_parser(
        "runs", parents=[common], help="list, show, restart, revive and complete runs",
        description="Runs as the store holds them (every namespace). Exit 1 when the run is not found or "
        "the action is refused.").add_subparsers(dest="runs_command", required=True,
                                                 metavar="{list,show,restart,revive,complete}")
    listing = _leaf(runs, common, "list", "runs, newest first")
    listing.add_argument("--state", choices=RUN_STATES)
    listing.add_argument("--limit", type=int, default=100)
    listing.set_defaults(handler=cmd_runs_list)
    for name, handler, help in (("show", cmd_runs_show, "one run, its history and its journal"),
                                ("restart", cmd_runs_restart, "start a new attempt now and fire its hook "
                                 "(a dead run is revived)"),
                                ("revive", cmd_runs_revive, "give a dead run a new attempt, its restarts "
                                 "forgotten, and fire its hook"),
                                ("complete", cmd_runs_complete, "mark a run completed")):
        leaf = _leaf(runs, common, name, help)
        leaf.add_argument("run_id")
        leaf.add_argument("--namespace", help="where the run id exists in several namespaces")
        leaf.set_defaults(handler=handler)

    journal = sub.add_parser(
        "journal", parents=[common], help="find, show and resolve journal entries",
        description=f"Journal entries of every run. Tables show the first {KID_SHOWN} digits of a kid; "
        "show and resolve take any unique start of one (6 digits or more).").add_subparsers(
        dest="journal_command", required=True, metavar="{list,show,find,resolve}")
    listing = _leaf(journal, common, "list", "journal entries of every run, newest first")
    listing.add_argument("--state", choices=JOURNAL_STATES, help="quarantined = outcome unknown")
    listing.add_argument("--limit", type=int, default=100)
    listing.set_defaults(handler=cmd_journal_list)
    show = _leaf(journal, common, "show", "one entry: its key, fingerprint and recorded response")
    show.add_argument("kid", help="the entry's kid, or a unique start of it")
    show.set_defaults(handler=cmd_journal_show)
    find = _leaf(journal, common, "find", "entries recorded under the agent's own Idempotency-Key")
    find.add_argument("key", help="the Idempotency-Key as the agent sent it")
    find.add_argument("--tenant", help="as entries show it (t:NAME, k:HASH); a bare NAME is t:NAME")
    find.add_argument("--run", help="the run id the entry belongs to")
    find.add_argument("--limit", type=int, default=100)
    find.set_defaults(handler=cmd_journal_find)
    resolve = journal.add_parser(
        "resolve", parents=[common], help="decide a quarantined key: retry it, or give its answer",
        description="Decide a quarantined entry (its outcome upstream is unknown): --retry lets the next "
        "call go upstream again; --status (with --body and --header) records the answer every call "
        "replays from now on.")
    resolve.add_argument("kid", help="the entry's kid, or a unique start of it (idemproxy journal list "
                         "--state quarantined)")
    decision = resolve.add_mutually_exclusive_group(required=True)
    decision.add_argument("--retry", action="store_true", help="the next call goes upstream again")
    decision.add_argument("--status", type=int, help="replay this status from now on")
    resolve.add_argument("--body", default="", help="the body to replay with --status")
    resolve.add_argument("--header", action="append", default=[], metavar="NAME:VALUE",
                         help="a header to replay with --status (default Content-Type: application/json)")
    resolve.set_defaults(handler=cmd_journal_resolve)


KID_SHOWN = 12  # digits of a kid in tables: unique among millions of entries, and short


def _leaf(sub, common: argparse.ArgumentParser, name: str, help: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, parents=[common], help=help, description=help)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def _with_runs(settings: Settings, work: Callable[[RunsService], Awaitable[int]], migrate: bool = False) -> int:
    """Run ``work`` over the runs service of the configured store; a refusal is one line
    on stderr and exit code 1. Only ``migrate`` creates or upgrades the schema: a command
    about runs finds nothing in a store without one."""
    async def main() -> int:
        store = await open_store(settings, migrate=migrate)
        hooks = Hooks(settings, store)
        try:
            return await work(RunsService(store, settings, hooks))
        except Problem as problem:
            print(f"idemproxy: {problem.detail}", file=sys.stderr)
            return 1
        finally:
            await hooks.aclose(timeout=30.0)  # a restart's http hook is delivered before we exit
            await store.aclose()
    return run(main)


# -- supervise ----------------------------------------------------------------------------------

def cmd_supervise(settings: Settings, args=None) -> int:
    async def work(runs: RunsService) -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)  # only enqueue; the loop decides when
        await Supervisor(runs, settings).run(stop)
        return 0
    return _with_runs(settings, work, migrate=True)


# -- runs ---------------------------------------------------------------------------------------

def cmd_runs_list(settings: Settings, args) -> int:
    async def work(service: RunsService) -> int:
        runs, steps = await service.listing(args.state, args.limit)
        if args.json:
            _print_json(listing_json(runs, steps, settings.proxy_url))
            return 0
        now = time.time()
        print(table(["RUN", "NAMESPACE", "STATE", "EPOCH", "RESTARTS", "LAST SEEN", "HOOK"],
                    [[r.run_id, r.namespace, r.state, r.epoch, r.restarts, ago(r.last_seen, now),
                      r.hook or "-"] for r in runs]) if runs else "no runs")
        return 0
    return _with_runs(settings, work)


def cmd_runs_show(settings: Settings, args) -> int:
    async def work(service: RunsService) -> int:
        found = await service.find(args.run_id, args.namespace)
        body = run_json(found, settings.proxy_url, history=True)
        body["steps"] = [step_json(e) for e in await service.journal(found)]
        body["actions"] = [a.as_json() for a in await service.actions(found)]
        if args.json:
            _print_json(body)
        else:
            print(describe(body, time.time()))
        return 0
    return _with_runs(settings, work)


def cmd_runs_restart(settings: Settings, args) -> int:
    return _new_attempt(settings, args, "restarted", lambda service: service.restart_now)


def cmd_runs_revive(settings: Settings, args) -> int:
    return _new_attempt(settings, args, "revived", lambda service: service.revive)


# the CLI's operator actions are kept with its user and host (proxy/runs/operators.py)


def _new_attempt(settings: Settings, args, done: str,
                 action: Callable[[RunsService], Callable[..., Awaitable[Run]]]) -> int:
    """An operator's new attempt of a run (``action`` of the service), reported."""
    async def work(service: RunsService) -> int:
        new = await action(service)(args.run_id, args.namespace, by=cli_operator())
        return _report(args, run_json(new, settings.proxy_url, history=True),
                       f"run {new.run_id}: {done} at epoch {new.epoch} (restart {new.restarts}); "
                       f"hook {new.hook or '-'}")
    return _with_runs(settings, work)


def cmd_runs_complete(settings: Settings, args) -> int:
    async def work(service: RunsService) -> int:
        found = await service.find(args.run_id, args.namespace)
        ended = await service.end(found.namespace, found.run_id, RunState.COMPLETED, by=cli_operator())
        return _report(args, run_json(ended, settings.proxy_url, history=True),
                       f"run {ended.run_id}: completed")
    return _with_runs(settings, work)


# -- journal ------------------------------------------------------------------------------------

def cmd_journal_list(settings: Settings, args) -> int:
    async def work(service: RunsService) -> int:
        entries = await service.entries(journal_state(args.state), args.limit)
        return _print_entries(args, entries, "no journal entries" + (f" {args.state}" if args.state else ""))
    return _with_runs(settings, work)


def cmd_journal_find(settings: Settings, args) -> int:
    async def work(service: RunsService) -> int:
        entries = await service.find_key(args.key, tenant=args.tenant, run=args.run, limit=args.limit)
        return _print_entries(args, entries, f"no entry has the Idempotency-Key {args.key!r}")
    return _with_runs(settings, work)


def cmd_journal_show(settings: Settings, args) -> int:
    async def work(service: RunsService) -> int:
        entry = await service.entry(await service.kid(args.kid))
        body = entry_json(entry)
        body["evidence"] = entry.evidence
        body["actions"] = [a.as_json() for a in await service.entry_actions(entry.kid)]
        if args.json:
            if entry.response is not None:
                body["headers"] = entry.response.headers
                body["body_base64"] = base64.b64encode(entry.response.body).decode()
            _print_json(body)
        else:
            print(describe_entry(body, entry.response, time.time()))
        return 0
    return _with_runs(settings, work)


def cmd_journal_resolve(settings: Settings, args) -> int:
    if args.retry:
        body: dict[str, Any] = {"action": "retry"}
    else:
        headers = [h.split(":", 1) for h in args.header] or [["Content-Type", "application/json"]]
        if any(len(h) != 2 for h in headers):
            print("idemproxy: --header wants NAME:VALUE", file=sys.stderr)
            return 2
        body = {"action": "respond", "status": args.status, "body": args.body,
                "headers": [[k.strip(), v.strip()] for k, v in headers]}
    try:
        recorded = resolution(body)
    except Problem as problem:
        print(f"idemproxy: {problem.detail}", file=sys.stderr)
        return 2

    async def work(service: RunsService) -> int:
        kid = await service.kid(args.kid)
        await service.resolve(kid, recorded, by=cli_operator())
        then = "the next call goes upstream" if recorded is None else f"calls replay {recorded.status}"
        print(f"{kid}: resolved; {then}")
        return 0
    return _with_runs(settings, work)


# -- printing -----------------------------------------------------------------------------------

def _print_entries(args, entries: list[Entry], none: str) -> int:
    if args.json:
        _print_json({"entries": [entry_json(e) for e in entries]})
        return 0
    now = time.time()
    print(table(["KID", "KEY", "STATE", "RUN", "EPOCH", "UPSTREAM", "METHOD", "PATH", "STATUS", "CREATED"],
                [[e.kid[:KID_SHOWN], agent_key(e) or "-", e.state, e.run, e.epoch, e.upstream, e.method, e.path,
                  e.response.status if e.response else None, ago(e.created_at, now)] for e in entries])
          if entries else none)
    return 0


def _print_json(body: Any) -> None:
    sys.stdout.write(orjson.dumps(iso_times(body), option=orjson.OPT_INDENT_2).decode() + "\n")


def _report(args, body: dict, line: str) -> int:
    if args.json:
        _print_json(body)
    else:
        print(line)
    return 0


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
