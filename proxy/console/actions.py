"""The console's actions (POST): log in and out, resolve a quarantined key, revive a dead
run. Each changes the store only through the runs service, then redirects (303) back to a
page, which shows what was done."""

from __future__ import annotations

import hmac
from urllib.parse import parse_qsl, urlencode, urlsplit

from aiohttp import web

from ..appkeys import AUTH, CLIENTS, RUNS, SETTINGS
from ..ratelimit import same_token
from ..problems import Problem
from ..runs.api import run_id
from ..runs.operators import console_operator
from ..runs.options import resolution
from .sessions import COOKIE, LOGIN_COOKIE, LOGIN_FORM_S, SESSION_S, drop_cookie, login_token, set_cookie
from .site import SESSION, console, render


async def login_form(request: web.Request) -> web.Response:
    return _login(request, "", status=200)


async def login(request: web.Request) -> web.Response:
    form = await request.post()
    given_form, expected_form = str(form.get("form", "")), request.cookies.get(LOGIN_COOKIE, "")
    if not expected_form or not hmac.compare_digest(given_form, expected_form):
        return _login(request, "The login form expired; try again.", status=403)
    guard, client = request.config_dict[AUTH], request.config_dict[CLIENTS].of(request.headers, request.remote)
    # 429 for a client past its wrong tokens, before this one is compared; a wrong one is counted
    if not await guard.check(client, lambda: same_token(str(form.get("token", "")),
                                                         str(request.config_dict[SETTINGS].admin.token))):
        return _login(request, "That is not the admin token.", status=401)
    response = see_other(_back(request.query.get("next"), "/ui/runs"))
    set_cookie(response, request, COOKIE, (await console(request).sessions(request)).issue(), SESSION_S)
    drop_cookie(response, LOGIN_COOKIE)
    return response


async def logout(request: web.Request) -> web.Response:
    response = see_other("/ui/login")
    drop_cookie(response, COOKIE)
    return response


async def resolve(request: web.Request) -> web.Response:
    """Retry a quarantined key, or give the answer its replays return."""
    kid = request.match_info["kid"]
    form = await request.post()
    action = form.get("action")
    body: dict = {"action": action}
    if action == "respond":
        try:
            body["status"] = int(str(form.get("status", "")))
        except ValueError:
            raise Problem("invalid-body", "status must be an HTTP status from 200 to 599") from None
        body["headers"] = [list(_header(line)) for line in str(form.get("headers", "")).splitlines() if line.strip()]
        body["body"] = str(form.get("body", ""))
    await request.config_dict[RUNS].resolve(kid, resolution(body), by=_operator(request))
    done = "retried" if action == "retry" else "responded"
    return see_other(_with_done(_back(form.get("back"), f"/ui/journal/{kid}"), done))


async def revive(request: web.Request) -> web.Response:
    form = await request.post()
    new = await request.config_dict[RUNS].revive(run_id(request), str(form.get("namespace", "")) or None,
                                                 by=_operator(request))
    default = f"/ui/runs/{new.run_id}?namespace={new.namespace}"
    return see_other(_with_done(_back(form.get("back"), default), "revived"))


def _operator(request: web.Request) -> str:
    """Who acts: the admin token's name, and this session (the audit keeps it)."""
    return console_operator(request.config_dict[SETTINGS].admin, request[SESSION].sid)


def _login(request: web.Request, error: str, status: int) -> web.Response:
    """The login form, with a fresh double-submit token in its own short-lived cookie."""
    form = login_token()
    response = render(request, "login.html", status=status, error=error, form=form,
                      next=_back(request.query.get("next"), "/ui/runs"))
    set_cookie(response, request, LOGIN_COOKIE, form, LOGIN_FORM_S)
    return response


def _header(line: str) -> tuple[str, str]:
    name, sep, value = line.partition(":")
    if not sep:
        raise Problem("invalid-body", f"a header is Name: value, one per line; got {line.strip()!r}")
    return name.strip(), value.strip()


def _back(target: object, default: str) -> str:
    """Where to go after an action: a console page named by the form, never another site."""
    target = str(target or "")
    parts = urlsplit(target)
    if parts.scheme or parts.netloc or not target.startswith("/ui/") or "\\" in target:
        return default
    return target


def _with_done(target: str, done: str) -> str:
    """The page, told what was done (one word the page knows; never text from the form)."""
    parts = urlsplit(target)
    query = [(k, v) for k, v in parse_qsl(parts.query) if k != "done"] + [("done", done)]
    return parts._replace(query=urlencode(query)).geturl()


def see_other(location: str) -> web.Response:
    return web.Response(status=303, headers={"Location": location})
