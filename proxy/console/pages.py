"""The console's pages (GET): runs, a run's attempts, a journal entry, the quarantine,
savings, and the attempt logs hooks wrote. Every read goes through the runs service."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web

from ..appkeys import RUNS
from ..problems import Problem
from ..runs.api import run_id
from ..runs.bodies import readable
from ..runs.views import agent_key
from ..store.base import RUN_STATES, EntryState, Run, RunState
from . import charts
from .formats import num, usd
from .ledger import Saved
from .site import console, render
from .timeline import attempts

RUNS_SHOWN = 100  # rows on the runs page
RUNS_SEARCHED = 2000  # runs a search by id looks through
SAVINGS_RUNS = 500  # the newest runs the savings page adds up
LOG_TAIL_BYTES = 1 << 20
DONE = {"retried": "Resolved: the next call with this key goes upstream again.",
        "responded": "Resolved: calls with this key now replay the answer you gave.",
        "revived": "Revived: a new attempt has started and its hook was fired."}


async def home(request: web.Request) -> web.Response:
    return web.Response(status=303, headers={"Location": "/ui/runs"})


async def runs_page(request: web.Request) -> web.Response:
    service = request.config_dict[RUNS]
    state = request.query.get("state") or None
    if state is not None and state not in RUN_STATES:
        raise Problem("invalid-request", f"state must be one of {', '.join(RUN_STATES)}")
    search = request.query.get("q", "").strip()
    runs, steps = await service.listing(state, RUNS_SEARCHED if search else RUNS_SHOWN)
    if search:
        runs = [r for r in runs if search.lower() in r.run_id.lower()][:RUNS_SHOWN]
    saved = await _saved(request, runs)
    return render(request, "runs.html", runs=runs, steps=steps, saved=saved, state=state, search=search,
                  states=RUN_STATES, total=_total(saved.values()))


async def run_page(request: web.Request) -> web.Response:
    service = request.config_dict[RUNS]
    run = await service.find(run_id(request), request.query.get("namespace"))
    entries = await service.journal(run)
    ledger = console(request).ledger(request)
    spends = await ledger.spends(entries)
    return render(request, "run.html", run=run, attempts=attempts(run, entries, spends),
                  saved=await ledger.saved(entries), agent_key=agent_key, entries=len(entries),
                  done=DONE.get(request.query.get("done", "")))


async def entry_page(request: web.Request) -> web.Response:
    service = request.config_dict[RUNS]
    entry = await service.entry(request.match_info["kid"])
    if entry.run is not None:  # its replays by epoch come with the run's journal
        try:
            listed = {e.kid: e for e in await service.journal(await service.find(entry.run, entry.namespace))}
        except Problem:  # the run is gone; its entries outlive it until they expire
            listed = {}
        entry.replayed = listed[entry.kid].replayed if entry.kid in listed else {}
    kind, lines = readable(entry.response) if entry.response is not None else ("none", [])
    spent = (await console(request).ledger(request).spends([entry]))[entry.kid]
    return render(request, "entry.html", entry=entry, key=agent_key(entry), kind=kind, lines=lines,
                  spent=spent, done=DONE.get(request.query.get("done", "")))


async def quarantine_page(request: web.Request) -> web.Response:
    service = request.config_dict[RUNS]
    quarantined = await service.entries(EntryState.UNKNOWN, 500)
    dead, _ = await service.listing(RunState.DEAD, 500)
    return render(request, "quarantine.html", entries=quarantined, dead=dead, agent_key=agent_key,
                  done=DONE.get(request.query.get("done", "")))


async def savings_page(request: web.Request) -> web.Response:
    service = request.config_dict[RUNS]
    runs, _ = await service.listing(None, SAVINGS_RUNS)
    journals = await asyncio.gather(*(service.journal(r) for r in runs))
    ledger = console(request).ledger(request)
    tokens_at, cost_at, per_run = [], [], []
    for run, entries in zip(runs, journals):
        replayed = [e for e in entries if e.replayed]
        spends = await ledger.spends(replayed)
        saved = Saved()
        for entry in replayed:
            spent = spends[entry.kid]
            for n, first_seen in entry.replayed.values():
                tokens_at.append((first_seen, spent.tokens * n))
                cost_at.append((first_seen, (spent.cost or 0.0) * n))
            saved = saved.plus(spent, entry.replays)
        per_run.append((run, saved))
    total = _total(saved for _, saved in per_run)
    link = "/ui/runs/{}?namespace={}".format
    return render(
        request, "savings.html", total=total, runs=len(runs),
        tokens_chart=charts.over_time(tokens_at, num, title="Tokens saved by replays"),
        cost_chart=charts.over_time(cost_at, usd, title="Cost saved by replays (USD)") if total.cost else None,
        per_run_chart=charts.by_name([(r.run_id, s.tokens, link(r.run_id, r.namespace))
                                      for r, s in per_run][:SAVINGS_RUNS], num, title="Tokens saved per run"),
        top=sorted((p for p in per_run if p[1].tokens), key=lambda p: -p[1].tokens)[:20])


async def attempt_log(request: web.Request) -> web.StreamResponse:
    """The log file a command hook wrote for an attempt, named by the run's history (never
    by the URL), read on this machine: a supervisor elsewhere wrote it elsewhere."""
    service = request.config_dict[RUNS]
    run = await service.find(run_id(request), request.query.get("namespace"))
    try:
        event = run.history[int(request.match_info["index"])]
        path = Path(str(event["log"]))
    except (ValueError, IndexError, KeyError):
        raise Problem("not-found", "this history event names no log file") from None
    try:
        with path.open("rb") as log:
            size = log.seek(0, 2)
            log.seek(max(0, size - LOG_TAIL_BYTES))
            text = log.read()
    except OSError as exc:
        raise Problem("not-found", f"the log {path} is not readable on this machine ({exc.strerror})") from None
    return web.Response(body=text, content_type="text/plain", charset="utf-8")


async def unknown(request: web.Request) -> web.Response:
    raise Problem("not-found", f"no console page {request.path}")


async def _saved(request: web.Request, runs: list[Run]) -> dict[tuple[str, str], Saved]:
    service = request.config_dict[RUNS]
    ledger = console(request).ledger(request)
    journals = await asyncio.gather(*(service.journal(r) for r in runs))
    return {(r.namespace, r.run_id): await ledger.saved(entries) for r, entries in zip(runs, journals)}


def _total(each) -> Saved:
    total = Saved()
    for saved in each:
        total = Saved(total.tokens + saved.tokens, total.cost + saved.cost)
    return total
