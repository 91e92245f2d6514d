"""The console as an aiohttp sub-application at ``/ui/``: its routes, its state, and what
every page goes through.

- ``_gate``: without an ``[admin] token`` the console is off (a page says how to turn it
  on); otherwise a page needs a session (else the login page) and a POST its CSRF token.
- ``_html_problems``: a refusal is shown to a browser as a page; to anything that does not
  ask for HTML it stays problem+json (the app's one error middleware answers it).
- Every answer carries a strict Content-Security-Policy: the pages load their own CSS and
  script only, so a recorded body shown on a page can never run as code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib import resources
from typing import Any
from urllib.parse import quote

import jinja2
from aiohttp import web

from ..appkeys import RUNS, SETTINGS, STORE
from ..problems import Problem
from ..store.model import RunState
from .formats import FILTERS
from .ledger import Ledger
from .sessions import COOKIE, Session, Sessions, check_csrf

HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; script-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
OPEN_ROUTES = frozenset({"login", "login-submit"})  # reachable without a session


@dataclass
class Console:
    pages: jinja2.Environment
    _sessions: Sessions | None = None
    _ledger: Ledger | None = field(default=None)

    async def sessions(self, request: web.Request) -> Sessions:
        if self._sessions is None:
            # kept in the store, like the tenant key: the same on every replica, across restarts
            secret = await request.config_dict[STORE].secret("console-session", os.urandom(32))
            self._sessions = Sessions(secret, str(request.config_dict[SETTINGS].admin.token))
        return self._sessions

    def ledger(self, request: web.Request) -> Ledger:
        if self._ledger is None:
            self._ledger = Ledger(request.config_dict[RUNS], request.config_dict[SETTINGS])
        return self._ledger


CONSOLE = web.AppKey("console", Console)
SESSION = web.RequestKey("session", Session)
# what waits for an operator, shown in the navigation: (quarantined entries, dead runs)
WAITING = web.RequestKey("waiting", tuple)


def console_app(routes: list[tuple[str, str, Any, str | None]]) -> web.Application:
    """The sub-application, with ``routes`` as (method, path, handler, name)."""
    app = web.Application(middlewares=[_html_problems, _gate])
    pages = jinja2.Environment(loader=jinja2.PackageLoader("idemproxy.proxy.console", "templates"),
                               autoescape=True, undefined=jinja2.StrictUndefined)
    pages.filters.update(FILTERS)
    app[CONSOLE] = Console(pages)
    app.router.add_static("/static", str(resources.files("idemproxy.proxy.console") / "static"), name="static")
    for method, path, handler, name in routes:
        app.router.add_route(method, path, handler, name=name)
    return app


def render(request: web.Request, template: str, status: int = 200, **context: Any) -> web.Response:
    session = request.get(SESSION)
    page = request.app[CONSOLE].pages.get_template(template).render(
        csrf=session.csrf if session else "", here=request.path, query=request.query,
        waiting=request.get(WAITING, (0, 0)), **context)
    return web.Response(text=page, status=status, content_type="text/html", headers=HEADERS)


def console(request: web.Request) -> Console:
    return request.app[CONSOLE]


@web.middleware
async def _html_problems(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except Problem as problem:
        if "text/html" not in request.headers.get("Accept", ""):
            raise
        page = render(request, "error.html", status=problem.status, problem=problem)
        page.headers.update(problem.headers)  # Retry-After, say
        return page


@web.middleware
async def _gate(request: web.Request, handler) -> web.StreamResponse:
    route = request.match_info.route.name
    if route == "static":
        return await handler(request)
    if not request.config_dict[SETTINGS].admin.token:
        return render(request, "off.html", status=404)
    if route not in OPEN_ROUTES:
        session = (await console(request).sessions(request)).open(request.cookies.get(COOKIE))
        if session is None:
            if request.method != "GET":
                raise Problem("unauthorized", "log in to the console first")
            return web.Response(status=303, headers={"Location": "/ui/login?next=" + quote(request.path_qs, safe="")})
        if request.method == "POST":
            check_csrf(session.csrf, (await request.post()).get("csrf"))
        else:
            request[WAITING] = await _waiting(request)
        request[SESSION] = session
    response = await handler(request)
    response.headers.update(HEADERS)
    return response


async def _waiting(request: web.Request) -> tuple[int, int]:
    """Quarantined entries and dead runs, for the navigation's count: both counted by index,
    as the metrics count them, since every page (and its auto-refresh) asks."""
    store = request.config_dict[STORE]
    return await store.journal.count_quarantined(), (await store.runs.count()).get(RunState.DEAD, 0)
