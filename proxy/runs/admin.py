"""The admin API, for operators (docs/operations.md): a thin aiohttp face over :class:`RunsService`.

Every endpoint needs ``Authorization: Bearer <[admin] token>``; with no token configured
the API is off (always 401), never open::

    GET    /admin/runs?state=&limit=        {"runs": [run JSON + history + steps (a count)]}
    GET    /admin/runs/{id}[?namespace=][&bodies=1]
                                            run JSON + history + steps (the journal entries;
                                            bodies in base64 with bodies=1) + actions +
                                            refusals ({"count", "recent": the last 20})
    POST   /admin/runs/{id}[?namespace=]    register as the runs API does, for any namespace,
                                            and arm any hook (201 new, 200 updated)
    POST   /admin/runs/{id}/restart         a new attempt now, its hook fired
    POST   /admin/runs/{id}/revive          a dead run's new attempt, its restarts forgotten, its hook fired
    POST   /admin/runs/{id}/complete        marked completed
    DELETE /admin/runs/{id}/journal         {"deleted": n}
    GET    /admin/journal?state=&key=&tenant=&run=&limit=
                                            {"entries": [entry JSON]}, newest first; ``key`` is
                                            the agent's own Idempotency-Key, ``state`` may be
                                            "quarantined"
    GET    /admin/journal/{kid}             entry JSON + headers + body_base64 + evidence (a
                                            quarantined call's request and partial answer,
                                            proxy/evidence.py) + actions
    POST   /admin/journal/{kid}/resolve     {"action": "retry"} or {"action": "respond",
                                            "status", "headers": [[name, value]], "body" |
                                            "body_base64"}
    POST   /admin/purge                     {"purged": journal entries, "runs": runs} deleted

Every action (register, restart, revive, complete, journal delete, resolve) is kept in the audit with
the operator's name (proxy/runs/operators.py): ``actions`` on the run and the entry, each
``{"at", "by", "action", "namespace", "run", "kid", "detail"}``.

A run id found in several namespaces needs ``?namespace=`` (409 ``ambiguous-run``), as does
registering a run that exists in none.
"""

from __future__ import annotations

import base64

from aiohttp import web

from ..appkeys import AUTH, CLIENTS, METRICS, RUNS, SETTINGS
from ..ratelimit import same_token
from ..identity import TENANT_NAME
from ..problems import Problem
from ..store.model import RUN_STATES, RunState
from ..upstream.wire import as_text
from .api import answer, json_response, proxy_url, read_json, run_id
from .operators import token_operator
from .options import journal_state, json_object, resolution, run_options
from .views import entry_json, listing_json, run_json, step_json

CHALLENGE = {"WWW-Authenticate": 'Bearer realm="idemproxy-admin"'}


def admin_app() -> web.Application:
    """The admin API as a sub-application: its token check guards every route in it."""
    app = web.Application(middlewares=[_require_token])
    add = app.router
    add.add_get("/runs", list_runs)
    add.add_get("/runs/{run_id}", show_run)
    add.add_post("/runs/{run_id}", register)
    add.add_post("/runs/{run_id}/restart", restart)
    add.add_post("/runs/{run_id}/revive", revive)
    add.add_post("/runs/{run_id}/complete", complete)
    add.add_delete("/runs/{run_id}/journal", delete_journal)
    add.add_get("/journal", list_journal)
    add.add_get("/journal/{kid}", show_entry)
    add.add_post("/journal/{kid}/resolve", resolve)
    add.add_post("/purge", purge)
    add.add_route("*", "/{tail:.*}", unknown)
    return app


@web.middleware
async def _require_token(request: web.Request, handler) -> web.StreamResponse:
    token = request.config_dict[SETTINGS].admin.token
    if not token:
        raise Problem("unauthorized", "the admin API is disabled: no [admin] token is configured",
                      headers=CHALLENGE)
    guard, client = request.config_dict[AUTH], request.config_dict[CLIENTS].of(request.headers, request.remote)
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    # 429 for a client past its wrong tokens, before this one is compared; a wrong one is counted
    if not await guard.check(client, lambda: scheme.lower() == "bearer" and same_token(given.strip(), str(token))):
        raise Problem("unauthorized", "send Authorization: Bearer <admin token>", headers=CHALLENGE)
    return await handler(request)


async def list_runs(request: web.Request) -> web.Response:
    state = request.query.get("state") or None
    if state is not None and state not in RUN_STATES:
        raise Problem("invalid-request", f"state must be one of {', '.join(RUN_STATES)}")
    limit = _limit(request)
    runs, steps = await request.config_dict[RUNS].listing(state, limit)
    return json_response(listing_json(runs, steps, proxy_url(request)))


async def show_run(request: web.Request) -> web.Response:
    service = request.config_dict[RUNS]
    run = await service.find(run_id(request), request.query.get("namespace"))
    bodies = request.query.get("bodies") in ("1", "true", "yes")
    body = run_json(run, proxy_url(request), history=True)
    body["steps"] = []
    for entry in await service.journal(run, bodies=bodies):
        step = step_json(entry)
        if bodies and entry.response is not None:
            step["headers"] = [(k, as_text(v)) for k, v in entry.response.headers]
            step["body_base64"] = base64.b64encode(entry.response.body).decode()
        body["steps"].append(step)
    body["actions"] = [a.as_json() for a in await service.actions(run)]
    body["refusals"] = await service.refusals(run)
    return json_response(body)


async def register(request: web.Request) -> web.Response:
    """An operator's registration: the only way to arm a hook its namespace may not arm."""
    service = request.config_dict[RUNS]
    options = run_options(json_object(await read_json(request)), request.config_dict[SETTINGS])
    namespace = request.query.get("namespace")
    if namespace is None:
        namespace = (await service.find(run_id(request))).namespace  # 404 unless it exists
    elif not TENANT_NAME.fullmatch(namespace):
        raise Problem("invalid-request", "namespace must be 1-128 of [A-Za-z0-9._:@/-]")
    run, created = await service.register(namespace, run_id(request), options, operator=_operator(request))
    return answer(request, run, 201 if created else 200, history=True)


async def restart(request: web.Request) -> web.Response:
    new = await request.config_dict[RUNS].restart_now(run_id(request), request.query.get("namespace"),
                                                      by=_operator(request))
    request.config_dict[METRICS].restarts.inc()
    return answer(request, new, history=True)


async def revive(request: web.Request) -> web.Response:
    new = await request.config_dict[RUNS].revive(run_id(request), request.query.get("namespace"),
                                                 by=_operator(request))
    request.config_dict[METRICS].restarts.inc()
    return answer(request, new, history=True)


async def complete(request: web.Request) -> web.Response:
    service = request.config_dict[RUNS]
    run = await service.find(run_id(request), request.query.get("namespace"))
    return answer(request, await service.end(run.namespace, run.run_id, RunState.COMPLETED,
                                             by=_operator(request)), history=True)


async def delete_journal(request: web.Request) -> web.Response:
    service = request.config_dict[RUNS]
    run = await service.find(run_id(request), request.query.get("namespace"))
    deleted = await service.delete_journal(run, by=_operator(request))
    return json_response({"deleted": deleted, "namespace": run.namespace, "run_id": run.run_id})


async def list_journal(request: web.Request) -> web.Response:
    service, query = request.config_dict[RUNS], request.query
    state, limit = journal_state(query.get("state")), _limit(request)
    if query.get("key"):
        found = await service.find_key(query["key"], tenant=query.get("tenant") or None,
                                       run=query.get("run") or None, limit=limit)
        found = [e for e in found if state is None or e.state == state]
    elif query.get("tenant") or query.get("run"):
        raise Problem("invalid-request", "tenant and run narrow a search by key: add key=")
    else:
        found = await service.entries(state, limit)
    return json_response({"entries": [entry_json(e) for e in found]})


async def show_entry(request: web.Request) -> web.Response:
    service = request.config_dict[RUNS]
    entry = await service.entry(request.match_info["kid"])
    body = entry_json(entry)
    if entry.response is not None:
        body["headers"] = [(k, as_text(v)) for k, v in entry.response.headers]
        body["body_base64"] = base64.b64encode(entry.response.body).decode()
    body["evidence"] = entry.evidence
    body["actions"] = [a.as_json() for a in await service.entry_actions(entry.kid)]
    return json_response(body)


async def resolve(request: web.Request) -> web.Response:
    kid = request.match_info["kid"]
    recorded = resolution(json_object(await read_json(request)))
    await request.config_dict[RUNS].resolve(kid, recorded, by=_operator(request))
    return json_response({"resolved": True, "kid": kid, "action": "retry" if recorded is None else "respond"})


async def purge(request: web.Request) -> web.Response:
    entries, runs = await request.config_dict[RUNS].purge()
    return json_response({"purged": entries, "runs": runs})


def _operator(request: web.Request) -> str:
    """Who is acting: the token's configured name or fingerprint (the token checked it)."""
    return token_operator(request.config_dict[SETTINGS].admin)


def _limit(request: web.Request) -> int:
    try:
        limit = int(request.query.get("limit", "100"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 10000:
        raise Problem("invalid-request", "limit must be an integer from 1 to 10000")
    return limit


async def unknown(request: web.Request) -> web.Response:
    raise Problem("not-found", f"no admin endpoint {request.method} {request.path}")
