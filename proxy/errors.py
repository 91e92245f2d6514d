"""The one place errors become HTTP answers (RFC 9457 ``application/problem+json``).

Handlers raise; none of them builds an error answer::

    Problem            a refusal with a stable type slug (problems.py): its status, title
                       and outcome come from the PROBLEMS table
    StoreUnavailable   the store did not answer: 503 store-unavailable
    anything else      a bug: aiohttp answers 500 and logs it

A request the proxy handler took (it set STARTED) is also counted here, in metrics: its
outcome is final only once its error, if any, has been answered.
"""

from __future__ import annotations

import logging
import time

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from .metrics import Metrics
from .outcomes import Outcome
from .problems import PROBLEMS, Problem
from .replay import STREAM, cut_short, server_timing
from .store import StoreUnavailable

log = logging.getLogger("idemproxy.proxy")

OUTCOME = web.RequestKey("outcome", Outcome)  # what the proxy did: metrics and the access log
STARTED = web.RequestKey("started", float)  # time.perf_counter() when the proxy handler took it
UPSTREAM_S = web.RequestKey("upstream_s", object)  # upstream time to headers, when forwarded
# How a problem's body is put for a client that reads no problem+json (an MCP client reads JSON-RPC
# errors: proxy/mcp/upstream.py). It answers as application/json with the problem's status.
RENDER_PROBLEM = web.RequestKey("render_problem", object)


def problem_middleware(metrics: Metrics) -> Middleware:
    @web.middleware
    async def problems(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except Problem as problem:
            return answer(request, problem)
        except StoreUnavailable as exc:
            log.error("store unavailable: %s", exc)
            detail = "the journal store did not answer"
            if STARTED in request:  # SPEC §7: a record request fails closed
                detail += "; nothing was forwarded"
            return answer(request, Problem("store-unavailable", detail))
        finally:
            started = request.get(STARTED)
            if started is not None:
                metrics.observe(request[OUTCOME], time.perf_counter() - started, request.get(UPSTREAM_S))
    return problems


def answer(request: web.Request, problem: Problem) -> web.StreamResponse:
    """The problem as an answer, unless one is already under way."""
    if STREAM in request:  # the head is sent: a refusal can only cut the stream short
        return cut_short(request)
    kind = PROBLEMS[problem.slug]
    if kind.outcome is not None:
        request[OUTCOME] = kind.outcome
    path = request.path  # `OPTIONS *` and `CONNECT host:port` have none to name
    body = problem.body(instance=path if path[:1] == "/" else None)
    render = request.get(RENDER_PROBLEM)
    response = web.Response(status=kind.status, body=orjson.dumps(body) if render is None else render(body),
                            content_type="application/problem+json" if render is None else "application/json",
                            headers=problem.headers)
    started = request.get(STARTED)
    if started is not None:  # the proxy's answers carry its own time (SPEC §5)
        response.headers["Server-Timing"] = server_timing(time.perf_counter() - started)
    return response
