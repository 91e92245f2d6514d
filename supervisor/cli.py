"""Commands for runs: ``supervise``, ``runs list|show|restart|complete``, ``journal resolve``.

They talk to the store named by the same configuration as ``serve`` (``--config``,
``--store``, ``IDEMPROXY_*``), print aligned tables for people and JSON with ``--json``.
Exit codes: 0 done, 1 refused (not found, already ended, not quarantined).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from typing import Any, Awaitable, Callable

import orjson

from ..proxy.app import open_store
from ..proxy.config import Settings
from ..proxy.problems import Problem
from ..proxy.server import run
from ..proxy.store import Store
from ..proxy.store.base import ENDED, RUN_STATES, Run, RunState
from .api import resolution, resolve_quarantined, run_json, runs_listing, step_json
from .hooks import Hooks
from .loop import Supervisor, restart_run


def add_subcommands(sub, command) -> None:
    """Add our commands to the ``idemproxy`` parser (called by proxy/commands.py)."""
    supervise = command("supervise", "run the supervisor alone against the store (no proxy)")
    supervise.add_argument("--store", help="store URL")
    supervise.set_defaults(handler=cmd_supervise)

    runs = command("runs", "list, show, restart and complete runs").add_subparsers(
        dest="runs_command", required=True, metavar="{list,show,restart,complete}")
    listing = _leaf(runs, "list", "runs, newest first")
    listing.add_argument("--state", choices=RUN_STATES)
    listing.add_argument("--limit", type=int, default=100)
    listing.set_defaults(handler=cmd_runs_list)
    for name, handler, help in (("show", cmd_runs_show, "one run, its history and its journal"),
                                ("restart", cmd_runs_restart, "start a new attempt now and fire its hook"),
                                ("complete", cmd_runs_complete, "mark a run completed")):
        leaf = _leaf(runs, name, help)
        leaf.add_argument("run_id")
        leaf.add_argument("--namespace", help="where the run id exists in several namespaces")
        leaf.set_defaults(handler=handler)

    journal = command("journal", "act on journal entries").add_subparsers(
        dest="journal_command", required=True, metavar="{resolve}")
    resolve = _leaf(journal, "resolve", "decide a quarantined key: retry it, or give its answer")
    resolve.add_argument("kid", help="the entry's kid (idemproxy runs show RUN)")
    decision = resolve.add_mutually_exclusive_group(required=True)
    decision.add_argument("--retry", action="store_true", help="the next call goes upstream again")
    decision.add_argument("--status", type=int, help="replay this status from now on")
    resolve.add_argument("--body", default="", help="the body to replay with --status")
    resolve.add_argument("--header", action="append", default=[], metavar="NAME:VALUE",
                         help="a header to replay with --status (default Content-Type: application/json)")
    resolve.set_defaults(handler=cmd_journal_resolve)


def _leaf(sub, name: str, help: str) -> argparse.ArgumentParser:
    """A sub-subcommand that also takes the common options after its name."""
    p = sub.add_parser(name, help=help, description=help)
    # SUPPRESS: given before the subcommand, the value set there stays.
    p.add_argument("--config", "-c", default=argparse.SUPPRESS, help="TOML file")
    p.add_argument("--set", action="append", default=argparse.SUPPRESS,
                   metavar="SECTION.OPTION=VALUE", help="override one option; may repeat")
    p.add_argument("--store", default=argparse.SUPPRESS, help="store URL")
    if name != "resolve":
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def _with_store(settings: Settings, work: Callable[[Store], Awaitable[int]]) -> int:
    async def main() -> int:
        store = await open_store(settings)
        try:
            return await work(store)
        except Problem as problem:
            print(f"idemproxy: {problem.detail}", file=sys.stderr)
            return 1
        finally:
            await store.aclose()
    return run(main)


# -- supervise ----------------------------------------------------------------------------------

def cmd_supervise(settings: Settings, args=None) -> int:
    async def main() -> int:
        store = await open_store(settings)
        hooks = Hooks(settings, store)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)  # only enqueue; the loop decides when
        try:
            await Supervisor(store, settings, hooks).run(stop)
        finally:
            await hooks.aclose()
            await store.aclose()
        return 0
    return run(main)


# -- runs ---------------------------------------------------------------------------------------

def cmd_runs_list(settings: Settings, args) -> int:
    async def work(store: Store) -> int:
        runs = await store.runs.list(args.state, args.limit)
        if args.json:
            _print_json(await runs_listing(store, runs, settings.proxy_url))
            return 0
        now = time.time()
        print(table(["RUN", "NAMESPACE", "STATE", "EPOCH", "RESTARTS", "LAST SEEN", "HOOK"],
                    [[r.run_id, r.namespace, r.state, r.epoch, r.restarts, ago(r.last_seen, now),
                      r.hook or "-"] for r in runs]) if runs else "no runs")
        return 0
    return _with_store(settings, work)


def cmd_runs_show(settings: Settings, args) -> int:
    async def work(store: Store) -> int:
        found = await _find(store, args)
        body = run_json(found, settings.proxy_url, history=True)
        body["steps"] = [step_json(e) for e in await store.journal.entries(found.namespace, found.run_id)]
        if args.json:
            _print_json(body)
        else:
            print(describe(body, time.time()))
        return 0
    return _with_store(settings, work)


def cmd_runs_restart(settings: Settings, args) -> int:
    async def work(store: Store) -> int:
        found = await _find(store, args)
        if found.state in ENDED:
            raise Problem("run-ended", f"run {found.run_id} has ended ({found.state})")
        hooks = Hooks(settings, store)
        try:
            new = await restart_run(store, hooks, found, settings.proxy_url, reason="admin-restart",
                                    expected_epoch=None)
        finally:
            await hooks.aclose(timeout=30.0)
        if new is None:
            raise Problem("run-ended", f"run {found.run_id} ended meanwhile")
        return _report(args, run_json(new, settings.proxy_url, history=True),
                       f"run {new.run_id}: restarted at epoch {new.epoch} (restart {new.restarts}); "
                       f"hook {new.hook or '-'}")
    return _with_store(settings, work)


def cmd_runs_complete(settings: Settings, args) -> int:
    async def work(store: Store) -> int:
        found = await _find(store, args)
        ended = await store.runs.end(found.namespace, found.run_id, RunState.COMPLETED, time.time())
        if ended is None or ended.state != RunState.COMPLETED:
            raise Problem("run-ended", f"run {found.run_id} already ended as "
                          f"{ended.state if ended else 'unknown'}")
        return _report(args, run_json(ended, settings.proxy_url, history=True),
                       f"run {ended.run_id}: completed")
    return _with_store(settings, work)


async def _find(store: Store, args) -> Run:
    runs = await store.runs.find(args.namespace, args.run_id)
    if not runs:
        raise Problem("not-found", f"no run {args.run_id!r}")
    if len(runs) > 1:
        raise Problem("ambiguous-run", f"run {args.run_id!r} exists in namespaces "
                      f"{', '.join(sorted(r.namespace for r in runs))}; pass --namespace")
    return runs[0]


# -- journal ------------------------------------------------------------------------------------

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

    async def work(store: Store) -> int:
        await resolve_quarantined(store, settings, args.kid, recorded)
        then = "the next call goes upstream" if recorded is None else f"calls replay {recorded.status}"
        print(f"{args.kid}: resolved; {then}")
        return 0
    return _with_store(settings, work)


# -- printing -----------------------------------------------------------------------------------

def _print_json(body: Any) -> None:
    sys.stdout.write(orjson.dumps(body, option=orjson.OPT_INDENT_2).decode() + "\n")


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
              " ".join(f"{k}={v}" for k, v in e.items() if k not in ("at", "epoch", "event"))]
             for e in body["history"]])]
    steps = body["steps"]
    lines += ["", f"journal ({len(steps)} entries):"]
    if steps:
        lines.append(table(
            ["#", "KID", "UPSTREAM", "METHOD", "PATH", "STATE", "STATUS", "RECORDED", "REPLAYS", "EPOCH"],
            [[i, s["kid"], s["upstream"], s["method"], s["path"], s["state"], s["status"],
              ago(s["recorded_at"], now), s["replays"], s["epoch"]] for i, s in enumerate(steps, 1)]))
    return "\n".join(lines)
