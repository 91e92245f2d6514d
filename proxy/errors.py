"""The one error boundary: every refusal raised by any handler becomes problem+json here."""

from __future__ import annotations

from aiohttp import web

from .problems import Problem
from .store import StoreUnavailable


@web.middleware
async def problem_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except Problem as problem:
        return problem.response(request.path)
    except StoreUnavailable as exc:
        return Problem("store-unavailable", f"the store did not answer: {exc}").response(request.path)
