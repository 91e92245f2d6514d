"""The runs API, for agents (docs/guarantees.md, Paths): a thin aiohttp face over :class:`RunsService`.

Runs live in the caller's namespace (``TenantResolver.namespace``): the tenant named by the
``Idem-Tenant`` header from a trusted source, else its credential's tenant (``default`` for
everyone with ``[tenants] runs = "shared"``). Another namespace's run answers 404, as one that
does not exist. A registration arms a hook (its own or the ``[runs]`` default) only for a
namespace in that hook's ``allow_tenants`` (else 403 ``hook-not-allowed``; the admin API arms
any), and asks for no less time and no more restarts or metadata than ``[runs]`` allows (422
``outside-limits``). Refusals are raised as :class:`~..problems.Problem`; the app's one error
middleware answers them as problem+json. Times are UNIX seconds.

No admin token. Every answer about a run carries its ``token``, the run's capability: sent as
``Idem-Run-Token`` (or as ``/cap/{token}`` in a proxied call's path, which ``base_url``
holds), it puts a request in the run's namespace whatever credential it carries, so that an
attempt's traffic and its runs-API calls are one run. A caller with no credential that makes
a run gets a namespace of its own (``r:…``), reached with the token only. The run JSON agents
get has no ``history``, which is for operators::

    POST /runs/{id}            register: {timeout_s, grace_s, hook, max_restarts, metadata},
                               all optional -> 201 new, 200 updated          403, 422, 429
    GET  /runs/{id}            the run                                       404 if none
    POST /runs/{id}/heartbeat  alive now (work outside the proxy)            404, 412
    POST /runs/{id}/complete   ended for good: never restarted               404, 409, 412
    POST /runs/{id}/fail       likewise, as failed                           404, 409, 412
    POST /runs/{id}/attempts   a new attempt: epoch + 1, fencing the last -> 201 (creates
                               the run at epoch 0 if unknown)                409 run-ended
    POST /runs/{id}/attach     hold this attempt's connection (Idem-Epoch required): JSON
                               lines while it lives; see .attach       404, 409, 412
    POST /runs/{id}/detach     let its held connections go on purpose         404, 409, 412

Heartbeat, complete and fail take the caller's epoch (``Idem-Epoch``, or ``{"epoch": n}``
as the body): from a superseded attempt they change nothing and answer **412**
``stale-epoch``, so a zombie can neither keep its run alive nor end it.

The run JSON: ``run_id, namespace, state, epoch, restarts, last_seen, started_at,
timeout_s, grace_s, max_restarts, hook, metadata, created_at, ended_at, next_restart_at,
token, base_url`` (= ``{proxy}/runs/{id}/epochs/{epoch}/cap/{token}``).
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from ..appkeys import CLIENTS, RUNS, SETTINGS, TENANTS
from ..codings import decoded
from ..identity import ANONYMOUS, parse_run, private_namespace
from ..problems import Problem
from ..store.model import Run, RunState
from .attach import hold
from .options import attempt_epoch, json_object, run_options
from .views import run_json


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/runs/{run_id}", show)
    router.add_post("/runs/{run_id}", register)
    router.add_post("/runs/{run_id}/heartbeat", heartbeat)
    router.add_post("/runs/{run_id}/complete", complete)
    router.add_post("/runs/{run_id}/fail", fail)
    router.add_post("/runs/{run_id}/attempts", new_attempt)
    router.add_post("/runs/{run_id}/attach", attach)
    router.add_post("/runs/{run_id}/detach", detach)


async def register(request: web.Request) -> web.Response:
    options = run_options(json_object(await read_json(request)), request.config_dict[SETTINGS])
    run, created = await request.config_dict[RUNS].register(*_which(request, new=True), options,
                                                            client=_client(request))
    return own_answer(request, run, 201 if created else 200)


async def show(request: web.Request) -> web.Response:
    return own_answer(request, await request.config_dict[RUNS].get(*_which(request)))


async def heartbeat(request: web.Request) -> web.Response:
    epoch = await _epoch(request)
    return own_answer(request, await request.config_dict[RUNS].heartbeat(*_which(request), epoch))


async def complete(request: web.Request) -> web.Response:
    epoch = await _epoch(request)
    return own_answer(request, await request.config_dict[RUNS].end(*_which(request), RunState.COMPLETED, epoch))


async def fail(request: web.Request) -> web.Response:
    epoch = await _epoch(request)
    return own_answer(request, await request.config_dict[RUNS].end(*_which(request), RunState.FAILED, epoch))


async def new_attempt(request: web.Request) -> web.Response:
    run = await request.config_dict[RUNS].new_attempt(*_which(request, new=True), _client(request))
    return own_answer(request, run, 201)


async def attach(request: web.Request) -> web.StreamResponse:
    return await hold(request, *_which(request), await _epoch(request))


async def detach(request: web.Request) -> web.Response:
    epoch = await _epoch(request)
    if epoch is None:
        raise Problem("invalid-request", "detach lets one attempt's connections go: send its epoch as Idem-Epoch")
    return own_answer(request, await request.config_dict[RUNS].attach(*_which(request), epoch))


# -- shared with the admin API -------------------------------------------------------------------

def run_id(request: web.Request) -> str:
    try:
        return parse_run(request.match_info["run_id"])
    except Problem:
        raise Problem("invalid-request", "a run id is 1-128 characters of [A-Za-z0-9._:-]") from None


def proxy_url(request: web.Request) -> str:
    """Where the run JSON's ``base_url`` points: the configured URL, else the one the caller
    used (shown to that caller only; hooks are always told the configured one)."""
    configured = request.config_dict[SETTINGS].supervisor.proxy_url
    return configured.rstrip("/") if configured else f"{request.scheme}://{request.host}"


def answer(request: web.Request, run: Run, status: int = 200, *, history: bool = False) -> web.Response:
    return json_response(run_json(run, proxy_url(request), history=history), status)


def own_answer(request: web.Request, run: Run, status: int = 200) -> web.Response:
    """The run as its own agents see it: with its token, which only they are given."""
    token = request.config_dict[TENANTS].run_token(run.namespace, run.run_id)
    return json_response(run_json(run, proxy_url(request), token=token), status)


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def _which(request: web.Request, *, new: bool = False) -> tuple[str, str]:
    """(namespace, run id) of the caller's run: its run token's, else its own namespace's. A
    caller with no credential (``anonymous``) that makes a run (``new``) gets a namespace of
    its own, so that such callers never share runs: its run is reached with its token only."""
    run = run_id(request)
    namespace = request.config_dict[TENANTS].namespace(request.headers, request.remote, run=run)
    if new and namespace == ANONYMOUS:
        namespace = private_namespace()
    return namespace, run


def _client(request: web.Request) -> str:
    return request.config_dict[CLIENTS].of(request.headers, request.remote)


async def _epoch(request: web.Request) -> int | None:
    return attempt_epoch(request.headers.get("Idem-Epoch"), json_object(await read_json(request)))


async def read_json(request: web.Request) -> bytes:
    """The body's content: aiohttp hands bodies over as received (codings.py)."""
    return decoded(await request.read(), request.headers, request.config_dict[SETTINGS].server.max_request_bytes)
