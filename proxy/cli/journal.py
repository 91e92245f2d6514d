"""``journal list|show|find|resolve``: journal entries of every run, found, shown and
decided by an operator. Tables show a kid's first KID_SHOWN digits; ``show`` and ``resolve``
take any unique start of one."""

from __future__ import annotations

import argparse
import base64
import sys
import time
from typing import Any

from ..config import Settings
from ..problems import Problem
from ..runs import RunsService
from ..runs.operators import cli_operator
from ..runs.options import JOURNAL_STATES, journal_state, resolution
from ..runs.views import agent_key, entry_json
from ..store.model import Entry
from .common import CONFIG_ERROR, OK, leaf, print_json, with_runs
from .describe import KID_SHOWN, ago, describe_entry, table


def add_commands(sub, common: argparse.ArgumentParser) -> None:
    journal = sub.add_parser(
        "journal", parents=[common], help="find, show and resolve journal entries",
        description=f"Journal entries of every run. Tables show the first {KID_SHOWN} digits of a kid; "
        "show and resolve take any unique start of one (6 digits or more).").add_subparsers(
        dest="journal_command", required=True, metavar="{list,show,find,resolve}")
    listing = leaf(journal, common, "list", "journal entries of every run, newest first")
    listing.add_argument("--state", choices=JOURNAL_STATES, help="quarantined = outcome unknown")
    listing.add_argument("--limit", type=int, default=100)
    listing.set_defaults(handler=cmd_journal_list)
    show = leaf(journal, common, "show", "one entry: its key, fingerprint and recorded response")
    show.add_argument("kid", help="the entry's kid, or a unique start of it")
    show.set_defaults(handler=cmd_journal_show)
    find = leaf(journal, common, "find", "entries recorded under the agent's own Idempotency-Key")
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



def cmd_journal_list(settings: Settings, args) -> int:
    async def work(service: RunsService) -> int:
        entries = await service.entries(journal_state(args.state), args.limit)
        return print_entries(args, entries, "no journal entries" + (f" {args.state}" if args.state else ""))
    return with_runs(settings, work)


def cmd_journal_find(settings: Settings, args) -> int:
    async def work(service: RunsService) -> int:
        entries = await service.find_key(args.key, tenant=args.tenant, run=args.run, limit=args.limit)
        return print_entries(args, entries, f"no entry has the Idempotency-Key {args.key!r}")
    return with_runs(settings, work)


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
            print_json(body)
        else:
            print(describe_entry(body, entry.response, time.time()))
        return OK
    return with_runs(settings, work)


def cmd_journal_resolve(settings: Settings, args) -> int:
    if args.retry:
        body: dict[str, Any] = {"action": "retry"}
    else:
        headers = [h.split(":", 1) for h in args.header] or [["Content-Type", "application/json"]]
        if any(len(h) != 2 for h in headers):
            print("idemproxy: --header wants NAME:VALUE", file=sys.stderr)
            return CONFIG_ERROR
        body = {"action": "respond", "status": args.status, "body": args.body,
                "headers": [[k.strip(), v.strip()] for k, v in headers]}
    try:
        recorded = resolution(body)
    except Problem as problem:
        print(f"idemproxy: {problem.detail}", file=sys.stderr)
        return CONFIG_ERROR

    async def work(service: RunsService) -> int:
        kid = await service.kid(args.kid)
        await service.resolve(kid, recorded, by=cli_operator())
        then = "the next call goes upstream" if recorded is None else f"calls replay {recorded.status}"
        print(f"{kid}: resolved; {then}")
        return OK
    return with_runs(settings, work)


def print_entries(args, entries: list[Entry], none: str) -> int:
    if args.json:
        print_json({"entries": [entry_json(e) for e in entries]})
        return OK
    now = time.time()
    print(table(["KID", "KEY", "STATE", "RUN", "EPOCH", "UPSTREAM", "METHOD", "PATH", "STATUS", "CREATED"],
                [[e.kid[:KID_SHOWN], agent_key(e) or "-", e.state, e.run, e.epoch, e.upstream, e.method, e.path,
                  e.response.status if e.response else None, ago(e.created_at, now)] for e in entries])
          if entries else none)
    return OK


