"""The runs API (for agents) and the admin API (for operators), SPEC §8–§9.

Runs live in the caller's namespace: the tenant named by the ``Idem-Tenant`` header from
a trusted source, else ``default``. Every refusal is a problem+json :class:`Problem`.
Times are UNIX seconds.

Agents (no token; the run JSON they get has no ``history``, which is for operators)::

    POST /runs/{id}            register: {timeout_s, grace_s, hook, max_restarts, metadata},
                               all optional -> 201 new, 200 updated
    GET  /runs/{id}            the run                                       404 if none
    POST /runs/{id}/heartbeat  alive now (work outside the proxy)            404, 412
    POST /runs/{id}/complete   ended for good: never restarted               404, 409, 412
    POST /runs/{id}/fail       likewise, as failed                           404, 409, 412
    POST /runs/{id}/attempts   a new attempt: epoch + 1, fencing the last -> 201 (creates
                               the run at epoch 0 if unknown)                409 run-ended

Heartbeat, complete and fail take the caller's epoch (``Idem-Epoch``, or ``{"epoch": n}``
as the body): from a superseded attempt they change nothing and answer **412**
``stale-epoch``, so a zombie can neither keep its run alive nor end it.

The run JSON: ``run_id, namespace, state, epoch, restarts, last_seen, started_at,
timeout_s, grace_s, max_restarts, hook, metadata, created_at, ended_at, next_restart_at,
base_url`` (= ``{proxy}/runs/{id}/epochs/{epoch}``).

Operators (``Authorization: Bearer <[admin] token>``; no token configured: always 401)::

    GET    /admin/runs?state=&limit=        {"runs": [run JSON + history + steps (a count)]}
    GET    /admin/runs/{id}[?namespace=][&bodies=1]
                                            run JSON + history + steps (the journal entries;
                                            bodies in base64 with bodies=1)
    POST   /admin/runs/{id}/restart         a new attempt now, its hook fired
    POST   /admin/runs/{id}/complete        marked completed
    DELETE /admin/runs/{id}/journal         {"deleted": n}
    POST   /admin/journal/{kid}/resolve     {"action": "retry"} or {"action": "respond",
                                            "status", "headers": [[name, value]], "body" |
                                            "body_base64"}
    POST   /admin/purge                     {"purged": n}

A run id found in several namespaces needs ``?namespace=`` (409 ``ambiguous-run``).
"""

from __future__ import annotations

import base64
import binascii
import functools
import hmac
import re
import time
from typing import Any, AsyncIterator, Awaitable, Callable

import orjson
from aiohttp import web

from ..proxy.app import METRICS, PROXY, SETTINGS, STORE
from ..proxy.config import Settings, UpstreamSettings, parse_duration
from ..proxy.forward import NEVER_STORED, NOT_FORWARDED, storable_headers
from ..proxy.identity import parse_epoch, parse_run
from ..proxy.problems import Problem
from ..proxy.store import Store, StoreUnavailable
from ..proxy.store.base import ENDED, RUN_STATES, Entry, EntryState, Recorded, Run, RunState
from .hooks import Hooks
from .loop import restart_run

HOOKS = web.AppKey("hooks", Hooks)
RUN_OPTIONS = ("timeout_s", "grace_s", "hook", "max_restarts", "metadata")
MAX_METADATA_BYTES = 64 * 1024
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an RFC 9110 token
CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # never in a field value (RFC 9110 §5.5; HTAB may be)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def routes(app: web.Application) -> None:
    """Add the runs and admin APIs to ``app`` (before the proxy's catch-all route)."""
    app.cleanup_ctx.append(_hooks_lifecycle)
    add = app.router
    add.add_get("/runs/{run_id}", show_run)
    add.add_post("/runs/{run_id}", register_run)
    add.add_post("/runs/{run_id}/heartbeat", heartbeat)
    add.add_post("/runs/{run_id}/complete", complete)
    add.add_post("/runs/{run_id}/fail", fail)
    add.add_post("/runs/{run_id}/attempts", new_attempt)
    add.add_get("/admin/runs", admin_list)
    add.add_get("/admin/runs/{run_id}", admin_show)
    add.add_post("/admin/runs/{run_id}/restart", admin_restart)
    add.add_post("/admin/runs/{run_id}/complete", admin_complete)
    add.add_delete("/admin/runs/{run_id}/journal", admin_delete_journal)
    add.add_post("/admin/journal/{kid}/resolve", admin_resolve)
    add.add_post("/admin/purge", admin_purge)
    add.add_route("*", "/admin/{tail:.*}", admin_unknown)


async def _hooks_lifecycle(app: web.Application) -> AsyncIterator[None]:
    # Runs after the proxy's lifecycle opened the store, and closes before it.
    hooks = app[HOOKS] = Hooks(app[SETTINGS], app[STORE])
    yield
    await hooks.aclose()


# -- views (shared with the CLI) --------------------------------------------------------------

def run_json(run: Run, proxy_url: str, *, history: bool = False) -> dict[str, Any]:
    """A run as the API and ``idemproxy runs --json`` show it. ``history`` (hook errors,
    pids, log paths) is for operators only: the admin API and the CLI."""
    body = {"run_id": run.run_id, "namespace": run.namespace, "state": run.state, "epoch": run.epoch,
            "restarts": run.restarts, "last_seen": run.last_seen, "started_at": run.started_at,
            "timeout_s": run.timeout_s, "grace_s": run.grace_s, "max_restarts": run.max_restarts,
            "hook": run.hook, "metadata": run.metadata, "created_at": run.created_at,
            "ended_at": run.ended_at, "next_restart_at": run.next_restart_at,
            "base_url": f"{proxy_url}/runs/{run.run_id}/epochs/{run.epoch}"}
    if history:
        body["history"] = run.history
    return body


async def runs_listing(store: Store, runs: list[Run], proxy_url: str) -> dict[str, Any]:
    """``GET /admin/runs`` and ``idemproxy runs list --json``: each run with its number of
    journal entries as ``steps`` (``GET /admin/runs/{id}`` lists them)."""
    steps = await store.journal.count_steps([(r.namespace, r.run_id) for r in runs])
    return {"runs": [{**run_json(r, proxy_url, history=True), "steps": steps.get((r.namespace, r.run_id), 0)}
                     for r in runs]}


def step_json(entry: Entry) -> dict[str, Any]:
    """A journal entry of a run: metadata, no body. ``key`` is the agent's own
    Idempotency-Key as it sent it (see ``Scope.of_key``), or the key the proxy derived."""
    return {"key": entry.key.removeprefix("key:"), "kid": entry.kid, "upstream": entry.upstream,
            "method": entry.method,
            "path": entry.path, "state": entry.state,
            "status": entry.response.status if entry.response else None,
            "created_at": entry.created_at, "recorded_at": entry.completed_at,
            "replays": entry.replays, "epoch": entry.epoch, "detail": entry.detail}


# -- plumbing -----------------------------------------------------------------------------------

def _endpoint(*, admin: bool = False) -> Callable[[Handler], Handler]:
    """Turn Problems and store failures into problem+json; check the admin token first."""
    def wrap(fn: Handler) -> Handler:
        @functools.wraps(fn)
        async def handler(request: web.Request) -> web.StreamResponse:
            try:
                if admin:
                    _authorize(request)
                return await fn(request)
            except Problem as problem:
                return problem.response(request.path)
            except StoreUnavailable as exc:
                return Problem("store-unavailable", f"the store did not answer: {exc}").response(request.path)
        return handler
    return wrap


def _authorize(request: web.Request) -> None:
    token = request.app[SETTINGS].admin.token
    challenge = {"WWW-Authenticate": 'Bearer realm="idemproxy-admin"'}
    if not token:  # never open: no token configured means no admin API
        raise Problem("unauthorized", "the admin API is disabled: no [admin] token is configured",
                      headers=challenge)
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), str(token).encode()):
        raise Problem("unauthorized", "send Authorization: Bearer <admin token>", headers=challenge)


def _proxy_url(request: web.Request) -> str:
    configured = request.app[SETTINGS].supervisor.proxy_url
    return configured.rstrip("/") if configured else f"{request.scheme}://{request.host}"


def _answer(request: web.Request, run: Run, status: int = 200, *, history: bool = False) -> web.Response:
    return _json(run_json(run, _proxy_url(request), history=history), status)


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def _run_id(request: web.Request) -> str:
    try:
        return parse_run(request.match_info["run_id"])
    except Problem:
        raise Problem("invalid-request", "a run id is 1-128 characters of [A-Za-z0-9._:-]") from None


def _namespace(request: web.Request) -> str:
    return request.app[PROXY].tenants.namespace(request.headers, request.remote)


async def _body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise Problem("invalid-body", f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise Problem("invalid-body", "the body must be a JSON object")
    return body


async def _own_run(request: web.Request) -> Run:
    runs = await request.app[STORE].runs.find(_namespace(request), _run_id(request))
    if not runs:
        raise _no_such_run(request)
    return runs[0]


def _no_such_run(request: web.Request) -> Problem:
    return Problem("not-found", f"no run {request.match_info['run_id']!r} in this namespace")


async def _any_run(request: web.Request) -> Run:
    """The run an operator names: ``?namespace=`` picks one where the id is in several."""
    run_id = _run_id(request)
    runs = await request.app[STORE].runs.find(request.query.get("namespace"), run_id)
    if not runs:
        raise Problem("not-found", f"no run {run_id!r}")
    if len(runs) > 1:
        names = sorted(r.namespace for r in runs)
        raise Problem("ambiguous-run", f"run {run_id!r} exists in several namespaces "
                      f"({', '.join(names)}); add ?namespace=", namespaces=names)
    return runs[0]


async def _attempt_epoch(request: web.Request) -> int | None:
    """The epoch the caller works in: ``Idem-Epoch``, or ``{"epoch": n}`` as the body."""
    header = parse_epoch(request.headers.get("Idem-Epoch"))
    body = await _body(request)
    if set(body) - {"epoch"}:
        raise Problem("invalid-body", f"unknown field(s): {', '.join(sorted(set(body) - {'epoch'}))}; "
                      "known: epoch")
    given = body.get("epoch")
    if given is not None and (isinstance(given, bool) or not isinstance(given, int)
                              or not 0 <= given < 10 ** 18):  # as Idem-Epoch: at most 18 digits
        raise Problem("invalid-body", "epoch must be a non-negative integer")
    if header is not None and given is not None and header != given:
        raise Problem("invalid-request", f"Idem-Epoch ({header}) and the body's epoch ({given}) differ")
    return header if header is not None else given


def _not_superseded(run: Run, epoch: int | None) -> None:
    """Refuse a caller from an attempt older than the run's (the store changed nothing)."""
    if epoch is not None and run.epoch > epoch:
        raise Problem("stale-epoch", f"run {run.run_id} is at epoch {run.epoch}; this attempt "
                      f"(epoch {epoch}) has been superseded", epoch=run.epoch)


def run_options(body: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """Validated run options from a registration body."""
    unknown = set(body) - set(RUN_OPTIONS)
    if unknown:
        raise Problem("invalid-body", f"unknown field(s): {', '.join(sorted(unknown))}; "
                      f"known: {', '.join(RUN_OPTIONS)}")
    options: dict[str, Any] = {}
    for name in ("timeout_s", "grace_s"):
        if name in body:
            value = body[name]
            try:
                seconds = parse_duration(value) if not isinstance(value, bool) else -1.0
            except ValueError:
                seconds = -1.0
            if not seconds > 0:
                raise Problem("invalid-body", f"{name} must be a positive number of seconds")
            options[name] = seconds
    if "max_restarts" in body:
        value = body["max_restarts"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise Problem("invalid-body", "max_restarts must be a non-negative integer")
        options["max_restarts"] = value
    if "hook" in body:
        hook = body["hook"]
        if hook is not None and (not isinstance(hook, str) or hook not in settings.hooks):
            raise Problem("invalid-body", f"hook must be one of the configured hooks "
                          f"({', '.join(settings.hooks) or 'none configured'}) or null")
        options["hook"] = hook
    if "metadata" in body:
        metadata = body["metadata"]
        if not isinstance(metadata, dict) or len(orjson.dumps(metadata)) > MAX_METADATA_BYTES:
            raise Problem("invalid-body", f"metadata must be a JSON object of at most "
                          f"{MAX_METADATA_BYTES} bytes")
        options["metadata"] = metadata
    return options


def new_run(namespace: str, run_id: str, settings: Settings, now: float) -> Run:
    """A run at epoch 0 with the configured ``[runs]`` defaults."""
    d = settings.runs
    return Run(namespace, run_id, state=RunState.RUNNING, epoch=0, last_seen=now, started_at=now,
               timeout_s=d.timeout_s, grace_s=d.grace_s, max_restarts=d.max_restarts, hook=d.hook,
               created_at=now)


async def _end(request: web.Request, namespace: str, run_id: str, state: str,
               epoch: int | None = None) -> Run:
    """End the run as ``state``, atomically fenced by ``epoch``; idempotent."""
    ended = await request.app[STORE].runs.end(namespace, run_id, state, time.time(), epoch)
    if ended is None:
        raise _no_such_run(request)
    _not_superseded(ended, epoch)
    if ended.state != state:
        raise Problem("run-ended", f"run {run_id} already ended as {ended.state}", state=ended.state)
    return ended


# -- agent-facing -------------------------------------------------------------------------------

@_endpoint()
async def register_run(request: web.Request) -> web.Response:
    store, settings = request.app[STORE], request.app[SETTINGS]
    namespace, run_id = _namespace(request), _run_id(request)
    options = run_options(await _body(request), settings)
    existing = await store.runs.find(namespace, run_id)
    run = existing[0] if existing else new_run(namespace, run_id, settings, time.time())
    for name, value in options.items():
        setattr(run, name, value)
    return _answer(request, await store.runs.upsert(run), 200 if existing else 201)


@_endpoint()
async def show_run(request: web.Request) -> web.Response:
    return _answer(request, await _own_run(request))


@_endpoint()
async def heartbeat(request: web.Request) -> web.Response:
    namespace, run_id = _namespace(request), _run_id(request)
    epoch = await _attempt_epoch(request)
    run = await request.app[STORE].runs.heartbeat(namespace, run_id, time.time(), epoch)
    if run is None:
        raise _no_such_run(request)
    _not_superseded(run, epoch)
    return _answer(request, run)


@_endpoint()
async def complete(request: web.Request) -> web.Response:
    namespace, run_id = _namespace(request), _run_id(request)
    return _answer(request, await _end(request, namespace, run_id, RunState.COMPLETED, await _attempt_epoch(request)))


@_endpoint()
async def fail(request: web.Request) -> web.Response:
    namespace, run_id = _namespace(request), _run_id(request)
    return _answer(request, await _end(request, namespace, run_id, RunState.FAILED, await _attempt_epoch(request)))


@_endpoint()
async def new_attempt(request: web.Request) -> web.Response:
    store = request.app[STORE]
    namespace, run_id = _namespace(request), _run_id(request)
    runs = await store.runs.find(namespace, run_id)
    if not runs:
        run = await store.runs.upsert(new_run(namespace, run_id, request.app[SETTINGS], time.time()))
        return _answer(request, run, 201)
    run = await store.runs.new_attempt(namespace, run_id, None, time.time(), "attempt", restart=False)
    if run is None:
        raise Problem("run-ended", f"run {run_id} has ended ({runs[0].state}); start a new run",
                      state=runs[0].state)
    return _answer(request, run, 201)


# -- admin --------------------------------------------------------------------------------------

@_endpoint(admin=True)
async def admin_list(request: web.Request) -> web.Response:
    state = request.query.get("state") or None
    if state is not None and state not in RUN_STATES:
        raise Problem("invalid-request", f"state must be one of {', '.join(RUN_STATES)}")
    try:
        limit = int(request.query.get("limit", "100"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 10000:
        raise Problem("invalid-request", "limit must be an integer from 1 to 10000")
    store = request.app[STORE]
    return _json(await runs_listing(store, await store.runs.list(state, limit), _proxy_url(request)))


@_endpoint(admin=True)
async def admin_show(request: web.Request) -> web.Response:
    store = request.app[STORE]
    run = await _any_run(request)
    body = run_json(run, _proxy_url(request), history=True)
    entries = await store.journal.entries(run.namespace, run.run_id)
    body["steps"] = [step_json(e) for e in entries]
    if request.query.get("bodies") in ("1", "true", "yes"):
        for step in body["steps"]:
            full = await store.journal.get(step["kid"])
            if full is not None and full.response is not None:
                step["headers"] = full.response.headers
                step["body_base64"] = base64.b64encode(full.response.body).decode()
    return _json(body)


@_endpoint(admin=True)
async def admin_restart(request: web.Request) -> web.Response:
    app = request.app
    run = await _any_run(request)
    if run.state in ENDED:
        raise Problem("run-ended", f"run {run.run_id} has ended ({run.state})", state=run.state)
    new = await restart_run(app[STORE], app[HOOKS], run, _proxy_url(request), reason="admin-restart",
                            expected_epoch=None)
    if new is None:
        raise Problem("run-ended", f"run {run.run_id} ended meanwhile")
    app[METRICS].restarts.inc()
    return _answer(request, new, history=True)


@_endpoint(admin=True)
async def admin_complete(request: web.Request) -> web.Response:
    run = await _any_run(request)
    return _answer(request, await _end(request, run.namespace, run.run_id, RunState.COMPLETED), history=True)


@_endpoint(admin=True)
async def admin_delete_journal(request: web.Request) -> web.Response:
    run = await _any_run(request)
    deleted = await request.app[STORE].journal.delete_run(run.namespace, run.run_id)
    return _json({"deleted": deleted, "namespace": run.namespace, "run_id": run.run_id})


@_endpoint(admin=True)
async def admin_resolve(request: web.Request) -> web.Response:
    app, kid = request.app, request.match_info["kid"]
    recorded = resolution(await _body(request))
    await resolve_quarantined(app[STORE], app[SETTINGS], kid, recorded)
    return _json({"resolved": True, "kid": kid, "action": "retry" if recorded is None else "respond"})


async def resolve_quarantined(store: Store, settings: Settings, kid: str, recorded: Recorded | None) -> Entry:
    """Settle an outcome-unknown entry with the operator's decision (see :func:`resolution`).
    The answer's headers are kept as the proxy keeps an upstream's: no hop-by-hop or framing
    headers, no cookies, none of its upstream's ``redact_headers``."""
    entry = await store.journal.get(kid)
    if entry is None:
        raise Problem("not-found", f"no journal entry {kid}")
    if entry.state == EntryState.UNKNOWN:
        if recorded is not None:
            recorded.headers = _storable(recorded.headers, settings.upstreams.get(entry.upstream))
        if await store.journal.resolve(kid, recorded):
            return entry
    raise Problem("not-quarantined", f"entry {kid} is {entry.state}, not quarantined", state=entry.state)


def _storable(headers: list[tuple[str, str]], upstream: UpstreamSettings | None) -> list[tuple[str, str]]:
    kept = [(k, v) for k, v in headers if k.lower() not in NOT_FORWARDED]
    if upstream is None:  # no longer configured: its redactions are unknown, ours still hold
        return [(k, v) for k, v in kept if k.lower() not in NEVER_STORED]
    return storable_headers(kept, upstream)


def resolution(body: dict[str, Any]) -> Recorded | None:
    """The operator's decision on a quarantined key: None (retry) or the answer to replay."""
    action = body.get("action")
    if action == "retry":
        return None
    if action != "respond":
        raise Problem("invalid-body", 'action must be "retry" or "respond"')
    status = body.get("status")
    if isinstance(status, bool) or not isinstance(status, int) or not 200 <= status <= 599:
        raise Problem("invalid-body", "status must be an HTTP status from 200 to 599")
    headers = body.get("headers", [["Content-Type", "application/json"]])
    if not (isinstance(headers, list) and all(isinstance(h, list) and len(h) == 2
                                              and all(isinstance(x, str) for x in h) for h in headers)):
        raise Problem("invalid-body", 'headers must be a list of ["Name", "value"] pairs')
    for name, value in headers:
        if not HEADER_NAME.fullmatch(name) or CONTROL.search(value):
            raise Problem("invalid-body", f"header {name!r}: a name is a token (letters, digits, "
                          "!#$%&'*+.^_`|~-) and a value holds no control characters (CR, LF, NUL...)")
    if "body_base64" in body:
        try:
            content = base64.b64decode(str(body["body_base64"]), validate=True)
        except (binascii.Error, ValueError):
            raise Problem("invalid-body", "body_base64 is not base64") from None
    else:
        text = body.get("body", "")
        if not isinstance(text, str):
            raise Problem("invalid-body", "body must be text (or use body_base64)")
        content = text.encode()
    return Recorded(status, [(k, v) for k, v in headers], content)


@_endpoint(admin=True)
async def admin_purge(request: web.Request) -> web.Response:
    return _json({"purged": await request.app[STORE].journal.purge(time.time())})


@_endpoint(admin=True)
async def admin_unknown(request: web.Request) -> web.Response:
    raise Problem("not-found", f"no admin endpoint {request.method} {request.path}")
