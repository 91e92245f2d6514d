"""The operator console at ``/ui`` (docs/operations.md), served by the proxy itself.

Server-rendered pages over the runs service, behind the admin token; every asset ships in
this package (``templates/``, ``static/``), nothing is fetched at run time and nothing is
built with Node.

- :mod:`.site` — the sub-application: sessions or the login page, HTML errors, headers;
- :mod:`.sessions` — signed session cookies and CSRF tokens;
- :mod:`.pages` (GET) and :mod:`.actions` (POST) — the handlers;
- :mod:`.timeline` — a run's attempts one after the other, from its journal and history;
- :mod:`.ledger` — tokens and cost per recorded answer, what replays saved;
- :mod:`.charts` — inline SVG; :mod:`.formats` — times, money and counts as shown.
"""

from __future__ import annotations

from aiohttp import web

from . import actions, pages
from .site import console_app

ROUTES = [
    ("GET", "/", pages.home, "home"),
    ("GET", "/login", actions.login_form, "login"),
    ("POST", "/login", actions.login, "login-submit"),
    ("POST", "/logout", actions.logout, "logout"),
    ("GET", "/runs", pages.runs_page, "runs"),
    ("GET", "/runs/{run_id}", pages.run_page, "run"),
    ("GET", "/runs/{run_id}/log/{index}", pages.attempt_log, "log"),
    ("POST", "/runs/{run_id}/revive", actions.revive, "revive"),
    ("GET", "/journal", pages.journal_page, "journal"),
    ("GET", "/journal/{kid}", pages.entry_page, "entry"),
    ("POST", "/journal/{kid}/resolve", actions.resolve, "resolve"),
    ("GET", "/quarantine", pages.quarantine_page, "quarantine"),
    ("GET", "/savings", pages.savings_page, "savings"),
    ("*", "/{tail:.*}", pages.unknown, "unknown"),
]


def mount(app: web.Application) -> None:
    """Serve the console at ``/ui/`` (and ``/ui``) of the proxy's app, before its catch-all."""
    app.router.add_get("/ui", pages.home)
    app.add_subapp("/ui/", console_app(ROUTES))
