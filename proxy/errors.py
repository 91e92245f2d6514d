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

A request the proxy handler took (it made its Exchange, exchange.py) is also counted here,
in metrics: its outcome is final only once its error, if any, has been answered.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from .exchange import EXCHANGE, Exchange
from .observability.metrics import Metrics
from .problems import PROBLEMS, Problem
from .replay import cut_short, server_timing
from .store import StoreUnavailable

log = logging.getLogger("idemproxy.proxy")


def problem_middleware(metrics: Metrics, admit: Callable[[web.Request], None] | None = None,
                       observes: bool = True) -> Middleware:
    """The error boundary of each plane, its one middleware there (each one more costs every
    request a coroutine and a call): ``admit`` checks the request first, its refusals answered
    like any other. ``observes``: counts each proxied call's outcome and time in metrics, once
    its outcome is final (the data plane's; the control plane hands proxied calls to it)."""
    @web.middleware
    async def problems(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            if admit is not None:
                admit(request)
            return await handler(request)
        except Problem as problem:
            metrics.problem(problem.slug)
            exchange = request.get(EXCHANGE)
            if exchange is not None and exchange.run_call is not None:  # its run counts the refusal
                await exchange.run_call.refused(problem)  # (runs/refusals.py)
            return answer(request, problem)
        except StoreUnavailable as exc:
            metrics.problem("store-unavailable")
            log.error("store unavailable: %s", exc)
            detail = "the journal store did not answer"
            if _taken(request):  # a record request fails closed (docs/guarantees.md)
                detail += "; nothing was forwarded"
            return answer(request, Problem("store-unavailable", detail))
        except web.HTTPRequestEntityTooLarge:  # a chunked body past client_max_size
            return answer(request, Problem("too-large", "request body over max_request_bytes"))
        except ConnectionResetError:
            if not client_gone(request):
                raise  # not the client's connection: a bug
            return web.Response(status=499)  # nginx's "client closed request"; never sent
        finally:
            exchange = request.get(EXCHANGE) if observes else None
            if exchange is not None and exchange.started is not None:
                metrics.observe(exchange.outcome, time.perf_counter() - exchange.started, exchange.upstream_s)
    return problems


def _taken(request: web.BaseRequest) -> bool:
    """Whether the proxy handler took the request (made its Exchange)."""
    exchange = request.get(EXCHANGE)
    return exchange is not None and exchange.started is not None


def client_gone(request: web.BaseRequest) -> bool:
    """Whether the request's client connection is closed or closing."""
    transport = request.transport
    return transport is None or transport.is_closing()


def answer(request: web.Request, problem: Problem) -> web.StreamResponse:
    """The problem as an answer, unless one is already under way."""
    exchange = request.get(EXCHANGE)
    if exchange is not None and exchange.stream is not None:  # the head is sent: a refusal can
        return cut_short(request)  # only cut the stream short
    kind = PROBLEMS[problem.slug]
    if kind.outcome is not None:
        if exchange is None:  # refused before the proxy handler: its outcome still shows in the log
            exchange = request[EXCHANGE] = Exchange(started=None)
        exchange.outcome = kind.outcome
    path = request.path  # `OPTIONS *` and `CONNECT host:port` have none to name
    render = exchange.render_problem if exchange is not None else None
    response = problem_response(problem, instance=path if path[:1] == "/" else None, render=render)
    if exchange is not None and exchange.started is not None:  # the proxy's answers carry its own
        response.headers["Server-Timing"] = server_timing(time.perf_counter() - exchange.started)  # time
    return response


def problem_response(problem: Problem, instance: str | None = None, render=None) -> web.Response:
    """The problem as problem+json; ``render`` (an MCP upstream's) wraps it in another body."""
    body = problem.body(instance=instance)
    if render is not None:
        return web.Response(status=problem.status, body=render(body), content_type="application/json",
                            headers=problem.headers)
    return web.Response(status=problem.status, body=orjson.dumps(body), content_type="application/problem+json",
                        headers=problem.headers)
