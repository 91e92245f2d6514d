"""What every command shares: exit codes, how a subcommand is declared, and how a command
reaches the runs service of the configured store and prints what it found."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Awaitable, Callable

import orjson

from ...supervisor import Hooks
from ..config import Settings
from ..eventloop import run
from ..problems import Problem
from ..runs import RunsService
from ..runs.views import iso_times
from ..store import open_store

Command = Callable[[Settings, argparse.Namespace], int]

# Exit codes of every command (documented in the CLI reference)
OK, FAILED, CONFIG_ERROR = 0, 1, 2  # 2 is also argparse's, for a command line it cannot parse
MIGRATE_HINT = "run `idemproxy migrate`, or start `idemproxy serve`, which migrates"


def command(sub, common: argparse.ArgumentParser, name: str, summary: str, description: str):
    """A subcommand: ``summary`` in ``idemproxy --help``, ``description`` in its own."""
    return sub.add_parser(name, parents=[common], help=summary, description=description)


def leaf(sub, common: argparse.ArgumentParser, name: str, help: str) -> argparse.ArgumentParser:
    """A ``runs`` or ``journal`` subcommand, printing a table or, with ``--json``, JSON."""
    p = sub.add_parser(name, parents=[common], help=help, description=help)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def with_runs(settings: Settings, work: Callable[[RunsService], Awaitable[int]], migrate: bool = False) -> int:
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
            return FAILED
        finally:
            await hooks.aclose(timeout=30.0)  # a restart's http hook is delivered before we exit
            await store.aclose()
    return run(main)


def print_json(body: Any) -> None:
    sys.stdout.write(orjson.dumps(iso_times(body), option=orjson.OPT_INDENT_2).decode() + "\n")


def report(args, body: dict, line: str) -> int:
    """An action's result: ``line`` for people, ``body`` with ``--json``."""
    if args.json:
        print_json(body)
    else:
        print(line)
    return OK
