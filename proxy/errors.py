"""The one place errors become HTTP answers (RFC 9457 ``application/problem+json``).

Handlers raise; none of them builds an error answer::

    Problem            a refusal with a stable type slug (problems.py): its status, title
                       and outcome come from the PROBLEMS table
    StoreUnavailable   the store did not answer: 503 store-unavailable
    HTTPRequestEntityTooLarge
                       aiohttp's own body cap (``client_max_size``): 413 too-large
    ConnectionResetError
                       the client went away mid-request: 499, logged by the access line only
    anything else      a bug: 500 internal-error, logged with its traceback
                       (``connections.Connection.handle_error``)

A request the proxy handler took (it set STARTED) is also counted here, in metrics: its
outcome is final only once its error, if any, has been answered.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from .observability.metrics import Metrics
from .outcomes import Outcome
from .problems import PROBLEMS, Problem
from .replay import STREAM, cut_short, server_timing
from .runs.refusals import RUN_CALL
from .store import StoreUnavailable

log = logging.getLogger("idemproxy.proxy")

OUTCOME = web.RequestKey("outcome", Outcome)  # what the proxy did: metrics and the access log
STARTED = web.RequestKey("started", float)  # time.perf_counter() when the proxy handler took it
UPSTREAM_S = web.RequestKey("upstream_s", object)  # upstream time to headers, when forwarded
# How a problem's body is put for a client that reads no problem+json (an MCP client reads JSON-RPC
# errors: proxy/mcp/upstream.py). It answers as application/json with the problem's status.
RENDER_PROBLEM = web.RequestKey("render_problem", object)


def problem_middleware(metrics: Metrics, admit: Callable[[web.Request], None] | None = None) -> Middleware:
    """The app's one middleware (each one more costs every request a coroutine and a call),
    and the error boundary of what the front door sends straight to the proxy
    (app.front_door): ``admit`` checks the request first, its refusals answered like any other."""
    @web.middleware
    async def problems(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            if admit is not None:
                admit(request)
            return await handler(request)
        except Problem as problem:
            metrics.problem(problem.slug)
            call = request.get(RUN_CALL)
            if call is not None:  # a run's call: its run counts the refusal (runs/refusals.py)
                await call.refused(problem)
            return answer(request, problem)
        except StoreUnavailable as exc:
            metrics.problem("store-unavailable")
            log.error("store unavailable: %s", exc)
            detail = "the journal store did not answer"
            if STARTED in request:  # a record request fails closed (docs/guarantees.md)
                detail += "; nothing was forwarded"
            return answer(request, Problem("store-unavailable", detail))
        except web.HTTPRequestEntityTooLarge:  # a chunked body past client_max_size
            return answer(request, Problem("too-large", "request body over max_request_bytes"))
        except ConnectionResetError:
            if not client_gone(request):
                raise  # not the client's connection: a bug
            return web.Response(status=499)  # nginx's "client closed request"; never sent
        finally:
            started = request.get(STARTED)
            if started is not None:
                metrics.observe(request[OUTCOME], time.perf_counter() - started, request.get(UPSTREAM_S))
    return problems


def client_gone(request: web.BaseRequest) -> bool:
    """Whether the request's client connection is closed or closing."""
    transport = request.transport
    return transport is None or transport.is_closing()


def answer(request: web.Request, problem: Problem) -> web.StreamResponse:
    """The problem as an answer, unless one is already under way."""
    if STREAM in request:  # the head is sent: a refusal can only cut the stream short
        return cut_short(request)
    kind = PROBLEMS[problem.slug]
    if kind.outcome is not None:
        request[OUTCOME] = kind.outcome
    path = request.path  # `OPTIONS *` and `CONNECT host:port` have none to name
    render = request.get(RENDER_PROBLEM)
    response = problem_response(problem, instance=path if path[:1] == "/" else None, render=render)
    started = request.get(STARTED)
    if started is not None:  # the proxy's answers carry its own time (docs/guarantees.md)
        response.headers["Server-Timing"] = server_timing(time.perf_counter() - started)
    return response


def problem_response(problem: Problem, instance: str | None = None, render=None) -> web.Response:
    """The problem as problem+json; ``render`` (an MCP upstream's) wraps it in another body."""
    body = problem.body(instance=instance)
    if render is not None:
        return web.Response(status=problem.status, body=render(body), content_type="application/json",
                            headers=problem.headers)
    return web.Response(status=problem.status, body=orjson.dumps(body), content_type="application/problem+json",
                        headers=problem.headers)
