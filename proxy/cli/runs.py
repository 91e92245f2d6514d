"""``runs list|show|restart|revive|complete``: runs as the store holds them (every namespace),
printed as tables for people and JSON with ``--json``. An operator's action is kept with the
CLI's user and host (proxy/runs/operators.py)."""

from __future__ import annotations

import argparse
import time
from typing import Awaitable, Callable

from ..config import Settings
from ..runs import RunsService
from ..runs.operators import cli_operator
from ..runs.views import listing_json, run_json, step_json
from ..store.model import RUN_STATES, Run, RunState
from .common import OK, leaf, print_json, report, with_runs
from .describe import ago, describe, table


def add_commands(sub, common: argparse.ArgumentParser) -> None:
    runs = sub.add_parser(
        "runs", parents=[common], help="list, show, restart, revive and complete runs",
        description="Runs as the store holds them (every namespace). Exit 1 when the run is not found or "
        "the action is refused.").add_subparsers(dest="runs_command", required=True,
                                                 metavar="{list,show,restart,revive,complete}")
    listing = leaf(runs, common, "list", "runs, newest first")
    listing.add_argument("--state", choices=RUN_STATES)
    listing.add_argument("--limit", type=int, default=100)
    listing.set_defaults(handler=cmd_runs_list)
    for name, handler, help in (("show", cmd_runs_show, "one run, its history and its journal"),
                                ("restart", cmd_runs_restart, "start a new attempt now and fire its hook "
                                 "(a dead run is revived)"),
                                ("revive", cmd_runs_revive, "give a dead run a new attempt, its restarts "
                                 "forgotten, and fire its hook"),
                                ("complete", cmd_runs_complete, "mark a run completed")):
        action = leaf(runs, common, name, help)
        action.add_argument("run_id")
        action.add_argument("--namespace", help="where the run id exists in several namespaces")
        action.set_defaults(handler=handler)


def cmd_runs_list(settings: Settings, args) -> int:
    async def work(service: RunsService) -> int:
        runs, steps = await service.listing(args.state, args.limit)
        if args.json:
            print_json(listing_json(runs, steps, settings.proxy_url))
            return OK
        now = time.time()
        print(table(["RUN", "NAMESPACE", "STATE", "EPOCH", "RESTARTS", "LAST SEEN", "HOOK"],
                    [[r.run_id, r.namespace, r.state, r.epoch, r.restarts, ago(r.last_seen, now),
                      r.hook or "-"] for r in runs]) if runs else "no runs")
        return OK
    return with_runs(settings, work)


def cmd_runs_show(settings: Settings, args) -> int:
    async def work(service: RunsService) -> int:
        found = await service.find(args.run_id, args.namespace)
        body = run_json(found, settings.proxy_url, history=True)
        body["steps"] = [step_json(e) for e in await service.journal(found)]
        body["actions"] = [a.as_json() for a in await service.actions(found)]
        body["refusals"] = await service.refusals(found)
        if args.json:
            print_json(body)
        else:
            print(describe(body, time.time()))
        return OK
    return with_runs(settings, work)


def cmd_runs_restart(settings: Settings, args) -> int:
    return _new_attempt(settings, args, "restarted", lambda service: service.restart_now)


def cmd_runs_revive(settings: Settings, args) -> int:
    return _new_attempt(settings, args, "revived", lambda service: service.revive)


def _new_attempt(settings: Settings, args, done: str,
                 action: Callable[[RunsService], Callable[..., Awaitable[Run]]]) -> int:
    """An operator's new attempt of a run (``action`` of the service), reported."""
    async def work(service: RunsService) -> int:
        new = await action(service)(args.run_id, args.namespace, by=cli_operator())
        return report(args, run_json(new, settings.proxy_url, history=True),
                       f"run {new.run_id}: {done} at epoch {new.epoch} (restart {new.restarts}); "
                       f"hook {new.hook or '-'}")
    return with_runs(settings, work)


def cmd_runs_complete(settings: Settings, args) -> int:
    async def work(service: RunsService) -> int:
        found = await service.find(args.run_id, args.namespace)
        ended = await service.end(found.namespace, found.run_id, RunState.COMPLETED, by=cli_operator())
        return report(args, run_json(ended, settings.proxy_url, history=True),
                       f"run {ended.run_id}: completed")
    return with_runs(settings, work)
