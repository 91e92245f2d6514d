"""The console's pages (GET): runs, a run's attempts, a journal entry, the quarantine,
savings, and the attempt logs hooks wrote. Every read goes through the runs service."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from urllib.parse import urlencode

from aiohttp import web

from ..appkeys import RUNS, SETTINGS
from ..problems import Problem
from ..runs.api import run_id
from ..runs.bodies import readable
from ..runs.views import agent_key
from ..store.model import RUN_STATES, EntryState, Run, RunState
from . import charts
from .formats import num, usd
from .ledger import Saved
from .operators import evidence_parts, previews
from .site import console, render
from .timeline import attempts

RUNS_SHOWN = 100  # rows on a page of runs
RUNS_SEARCHED = 2000  # runs a filtered listing looks through (by id, namespace, time), newest first
SINCE = {"1h": 3600, "24h": 86400, "7d": 7 * 86400}  # "seen in the last ..." filter
ENTRIES_SHOWN = 200  # rows on the journal page
SAVINGS_RUNS = 500  # the newest runs the savings page adds up
LOG_TAIL_BYTES = 1 << 20
DONE = {"retried": "Resolved: the next call with this key goes upstream again.",
        "responded": "Resolved: calls with this key now replay the answer you gave.",
        "revived": "Revived: a new attempt has started and its hook was fired."}


async def home(request: web.Request) -> web.Response:
    return web.Response(status=303, headers={"Location": "/ui/runs"})


async def runs_page(request: web.Request) -> web.Response:
    """Runs, newest first, a page at a time: by state, id, namespace and last sign of life."""
    service, query = request.config_dict[RUNS], request.query
    state = query.get("state") or None
    if state is not None and state not in RUN_STATES:
        raise Problem("invalid-request", f"state must be one of {', '.join(RUN_STATES)}")
    search, namespace = query.get("q", "").strip(), query.get("namespace", "").strip()
    since = query.get("since") or None
    if since is not None and since not in SINCE:
        raise Problem("invalid-request", f"since must be one of {', '.join(SINCE)}")
    try:
        page = max(1, int(query.get("page") or 1))
    except ValueError:
        raise Problem("invalid-request", "page must be a number") from None
    filtered = bool(search or namespace or since)
    wanted = page * RUNS_SHOWN + 1  # one more than this page: is there a next one?
    runs, steps = await service.listing(state, max(wanted, RUNS_SEARCHED) if filtered else wanted)
    namespaces = sorted({r.namespace for r in runs})
    scanned_all = len(runs) < max(wanted, RUNS_SEARCHED)
    if search:
        runs = [r for r in runs if search.lower() in r.run_id.lower()]
    if namespace:
        runs = [r for r in runs if r.namespace == namespace]
    if since:
        runs = [r for r in runs if r.last_seen >= time.time() - SINCE[since]]
    more = len(runs) > page * RUNS_SHOWN
    runs = runs[(page - 1) * RUNS_SHOWN:page * RUNS_SHOWN]
    journals = await _journals(request, runs)
    saved = await _saved(request, runs, journals)
    here = {k: v for k, v in (("state", state), ("q", search), ("namespace", namespace), ("since", since)) if v}
    link = "/ui/runs?{}".format
    return render(request, "runs.html", runs=runs, steps=steps, saved=saved, state=state, search=search,
                  namespace=namespace, namespaces=namespaces, since=since, sinces=list(SINCE), page=page,
                  first=(page - 1) * RUNS_SHOWN + 1, scanned_all=scanned_all or not filtered,
                  searched=RUNS_SEARCHED, quarantined=_quarantined(runs, journals),
                  newer=link(urlencode({**here, "page": page - 1})) if page > 1 else None,
                  older=link(urlencode({**here, "page": page + 1})) if more else None,
                  states=RUN_STATES, total=_total(saved.values()))


async def run_page(request: web.Request) -> web.Response:
    service = request.config_dict[RUNS]
    run = await service.find(run_id(request), request.query.get("namespace"))
    entries = await service.journal(run)
    ledger = console(request).ledger(request)
    spends = await ledger.spends(entries)
    window = request.config_dict[SETTINGS].runs.restart_window_s
    return render(request, "run.html", run=run, attempts=attempts(run, entries, spends),
                  saved=await ledger.saved(entries), agent_key=agent_key, entries=len(entries),
                  quarantined=sum(1 for e in entries if e.state == EntryState.UNKNOWN),
                  counted=sum(1 for t in run.restart_times if t > time.time() - window), window=window,
                  done=DONE.get(request.query.get("done", "")), actions=await service.actions(run),
                  refusals=await service.refusals(run))


async def journal_page(request: web.Request) -> web.Response:
    """The journal of every run: by the agent's Idempotency-Key, the start of a kid, state,
    run or tenant, newest first."""
    service, query = request.config_dict[RUNS], request.query
    key, kid = query.get("key", "").strip(), query.get("kid", "").strip()
    run, tenant = query.get("run", "").strip() or None, query.get("tenant", "").strip() or None
    state = query.get("state") or None
    if state is not None and state not in tuple(EntryState):
        raise Problem("invalid-request", f"state must be one of {', '.join(EntryState)}")
    if kid:  # an entry named by its kid, as tables show it: straight to it
        return web.Response(status=303, headers={"Location": f"/ui/journal/{await service.kid(kid)}"})
    if key:
        found = await service.find_key(key, tenant=tenant, run=run, limit=ENTRIES_SHOWN)
        found = [e for e in found if state is None or e.state == state]
    else:
        if tenant is not None and ":" not in tenant and tenant != "anonymous":
            tenant = "t:" + tenant  # as find_key takes it
        found = await service.entries(state, ENTRIES_SHOWN, run=run, tenant=tenant)
    return render(request, "journal.html", entries=found, key=key, run=run or "", tenant=query.get("tenant", ""),
                  state=state, states=list(EntryState), agent_key=agent_key, limit=ENTRIES_SHOWN,
                  filtered=bool(key or run or tenant or state))


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
                  spent=spent, done=DONE.get(request.query.get("done", "")),
                  evidence=evidence_parts(entry.evidence), actions=await service.entry_actions(entry.kid))


async def quarantine_page(request: web.Request) -> web.Response:
    service = request.config_dict[RUNS]
    quarantined = await service.entries(EntryState.UNKNOWN, 500)
    dead, _ = await service.listing(RunState.DEAD, 500)
    return render(request, "quarantine.html", entries=quarantined, dead=dead, agent_key=agent_key,
                  done=DONE.get(request.query.get("done", "")), previews=await previews(service, quarantined))


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


async def _journals(request: web.Request, runs: list[Run]) -> list[list]:
    service = request.config_dict[RUNS]
    return list(await asyncio.gather(*(service.journal(r) for r in runs)))


async def _saved(request: web.Request, runs: list[Run], journals: list[list]) -> dict[tuple[str, str], Saved]:
    ledger = console(request).ledger(request)
    return {(r.namespace, r.run_id): await ledger.saved(entries) for r, entries in zip(runs, journals)}


def _quarantined(runs: list[Run], journals: list[list]) -> dict[tuple[str, str], int]:
    """Each run's entries whose outcome is unknown: a completed run may still hold some."""
    return {(r.namespace, r.run_id): sum(1 for e in entries if e.state == EntryState.UNKNOWN)
            for r, entries in zip(runs, journals)}


def _total(each) -> Saved:
    total = Saved()
    for saved in each:
        total = Saved(total.tokens + saved.tokens, total.cost + saved.cost)
    return total
