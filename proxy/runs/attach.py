"""Held connections (docs/restarts.md): ``POST /runs/{id}/attach`` with the attempt's ``Idem-Epoch``.

An agent started outside the supervisor's hooks (a Kubernetes Job, systemd, another host)
holds one such request open for its attempt; the client library does it with
``Run(attach=True)``. The proxy answers slowly, with JSON lines, and never ends while the
attempt is current::

    {"attached": n, "run_id": ..., "epoch": e, "keepalive_s": k, "grace_s": g}    at once
    {"alive": t}                                           every [runs] attach_keepalive_s
    {"ended": "completed"} | {"superseded": e2} | {"lost": e} | {"closing": true}   last

When the agent's process dies its kernel closes the socket; the proxy waits ``[runs]
attach_grace_s`` and, unless a connection of the same attempt was made meanwhile (on any
replica: the store numbers them), marks the attempt lost, and any supervisor restarts the
run at once. A client that reconnects within the grace (a network blip, a replica going
away) changes nothing. When the process runs on this host (``Idem-Process``, see
.process), the grace ends the moment it exits. ``{"closing": true}``: this proxy is shutting down and marks
nothing; reconnect. ``POST /runs/{id}/detach`` lets the attempt's connections go on
purpose (a process that hands its run on): their drop marks nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson
from aiohttp import web

from ..appkeys import ATTACHMENTS, RUNS, SETTINGS
from ..problems import Problem
from ..store import StoreUnavailable
from ..store.model import ENDED, Run
from .held import Attachments, Ending
from .process import HEADER, LocalProcess
from .service import RunsService

log = logging.getLogger("idemproxy.runs")


def setup(app: web.Application) -> None:
    """Held connections for ``app``: their watcher, and their end when the app shuts down."""
    app[ATTACHMENTS] = Attachments()

    async def close_all(app: web.Application) -> None:
        await app[ATTACHMENTS].close_all()
    app.on_shutdown.append(close_all)


async def hold(request: web.Request, namespace: str, run_id: str, epoch: int | None) -> web.StreamResponse:
    """Hold attempt ``epoch``'s connection until it drops or the attempt is over."""
    if epoch is None:
        raise Problem("invalid-request", "an attachment holds one attempt: send its epoch as Idem-Epoch")
    service, settings = request.config_dict[RUNS], request.config_dict[SETTINGS].runs
    process = LocalProcess.from_header(request.headers.get(HEADER))  # before anything is counted
    run = await service.attach(namespace, run_id, epoch)
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-store"})
    await response.prepare(request)
    ending = None
    try:
        ending = await _stream(request, response, run, epoch)
    except asyncio.CancelledError:  # aiohttp cancels the handler of a gone client, when so set
        ending = Ending.DROPPED
        raise
    finally:
        if ending == Ending.DROPPED:
            request.config_dict[ATTACHMENTS].after_drop(_after_drop(
                service, namespace, run_id, epoch, run.attachments, settings.attach_grace_s, process))
    return response


async def _stream(request: web.Request, response: web.StreamResponse, run: Run, epoch: int) -> Ending | None:
    """Keep-alive lines until the socket drops (DROPPED), the proxy shuts down (CLOSING) or
    the attempt is over (None)."""
    settings = request.config_dict[SETTINGS].runs
    held = request.config_dict[ATTACHMENTS]
    line = {"attached": run.attachments, "run_id": run.run_id, "epoch": epoch,
            "keepalive_s": settings.attach_keepalive_s, "grace_s": settings.attach_grace_s}
    while True:
        try:
            await response.write(orjson.dumps(line) + b"\n")
        except ConnectionResetError:
            return Ending.DROPPED
        if line.keys() & {"ended", "superseded", "lost", "closing"}:
            return Ending.CLOSING if "closing" in line else None
        ending = await held.wait(request, settings.attach_keepalive_s)
        if ending == Ending.DROPPED:
            return ending
        line = {"closing": True} if ending == Ending.CLOSING else await _news(request, run, epoch)


async def _news(request: web.Request, run: Run, epoch: int) -> dict:
    """The next line: the attempt is over, or it is alive."""
    try:
        now = await request.config_dict[RUNS].get(run.namespace, run.run_id)
    except (StoreUnavailable, Problem):  # the store is away (or the run deleted): hold on
        return {"alive": time.time()}
    if now.state in ENDED:
        return {"ended": now.state}
    if now.epoch > epoch:
        return {"superseded": now.epoch}
    if now.lost:
        return {"lost": epoch}
    return {"alive": time.time()}


async def _after_drop(service: RunsService, namespace: str, run_id: str, epoch: int, attachment: int,
                      grace_s: float, process: LocalProcess | None) -> None:
    """Wait out the grace (less once the process on this host is seen to exit), then mark
    the attempt lost unless it was held again meanwhile."""
    began = time.monotonic()
    if process is None:
        await asyncio.sleep(grace_s)
        exited = False
    else:
        exited = await process.exits_within(grace_s)
    waited = time.monotonic() - began if exited else grace_s
    try:
        await service.lose_attachment(namespace, run_id, epoch, attachment, waited, process_exited=exited)
    except StoreUnavailable as exc:  # then silence (timeout_s) restarts it
        log.warning("run %s/%s epoch %d: held connection gone, but not marked lost: %s", namespace,
                    run_id, epoch, exc)
