"""The console at /ui over HTTP (the browser tests are in test_console_browser.py): its
gate, its session cookie, its CSRF tokens, and what its pages say about real traffic."""

from __future__ import annotations

import re
from html import unescape

import aiohttp
import pytest

from console_traffic import (DEAD_RUN, QUARANTINED_KEY, RUN, buried, crashed_and_resumed, hook_sections,
                             quarantined_kid)
from idemproxy.proxy.store.model import EntryState, RunState

HTML = {"Accept": "text/html"}


@pytest.fixture
async def browser():
    """A client with a cookie jar that, like a browser, keeps cookies for 127.0.0.1."""
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
        yield session


async def login(browser, proxy, token: str = "test-admin-token") -> aiohttp.ClientResponse:
    async with browser.get(f"{proxy.url}/ui/login") as resp:
        form = re.search(r'name="form" value="([0-9a-f]+)"', await resp.text()).group(1)
    return await browser.post(f"{proxy.url}/ui/login?next=%2Fui%2Fquarantine", data={"form": form, "token": token},
                              allow_redirects=False)


def csrf_of(page: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', page).group(1)


def text(page: str) -> str:
    return unescape(re.sub(r"<[^>]+>", " ", page))


async def test_without_a_token_the_console_is_off_and_says_how_to_turn_it_on(make_proxy, sqlite_url, http):
    proxy = await make_proxy(sqlite_url, admin={"token": ""})
    for method, path in (("GET", "/ui/runs"), ("GET", "/ui/login"), ("POST", "/ui/login"), ("GET", "/ui/")):
        async with http.request(method, proxy.url + path, headers=HTML) as resp:
            page = await resp.text()
            assert resp.status == 404 and "The console is off" in page, (method, path)
            assert "IDEMPROXY_ADMIN_TOKEN" in page and "[admin]" in page


async def test_login_gives_a_signed_httponly_samesite_session_not_the_token(make_proxy, sqlite_url, browser):
    proxy = await make_proxy(sqlite_url)
    async with browser.get(f"{proxy.url}/ui/runs", allow_redirects=False) as resp:
        assert resp.status == 303 and resp.headers["Location"] == "/ui/login?next=%2Fui%2Fruns"
    async with await login(browser, proxy, token="wrong") as resp:
        assert resp.status == 401 and "not the admin token" in await resp.text()
    async with await login(browser, proxy) as resp:
        assert resp.status == 303 and resp.headers["Location"] == "/ui/quarantine"
        cookie = resp.cookies["idemproxy_console"]
        assert cookie["httponly"] and cookie["samesite"] == "Strict" and cookie["path"] == "/ui"
        assert not cookie["secure"]  # plain http on loopback: a Secure cookie would never come back
        assert "test-admin-token" not in cookie.value
    async with browser.get(f"{proxy.url}/ui/runs", allow_redirects=False) as resp:
        assert resp.status == 200
        assert "default-src 'none'" in resp.headers["Content-Security-Policy"]
        assert resp.headers["Cache-Control"] == "no-store"

    forged = cookie.value[:-2] + ("AA" if not cookie.value.endswith("AA") else "BB")
    async with aiohttp.ClientSession(cookies={"idemproxy_console": forged}) as other:
        async with other.get(f"{proxy.url}/ui/runs", allow_redirects=False) as resp:
            assert resp.status == 303  # a tampered session is no session
    async with browser.get(f"{proxy.url}/ui/login") as resp:  # behind TLS termination the cookie is Secure
        form = re.search(r'name="form" value="([0-9a-f]+)"', await resp.text()).group(1)
    async with browser.post(f"{proxy.url}/ui/login", data={"form": form, "token": "test-admin-token"},
                            headers={"X-Forwarded-Proto": "https"}, allow_redirects=False) as resp:
        assert resp.cookies["idemproxy_console"]["secure"]


async def test_a_session_of_another_admin_token_is_refused(make_proxy, sqlite_url, browser):
    first = await make_proxy(sqlite_url)
    async with await login(browser, first) as resp:
        assert resp.status == 303
        session = resp.cookies["idemproxy_console"].value
    second = await make_proxy(sqlite_url, admin={"token": "a-rotated-admin-token"})  # same store, new token
    async with aiohttp.ClientSession(cookies={"idemproxy_console": session}) as other:
        async with other.get(f"{second.url}/ui/runs", allow_redirects=False) as resp:
            assert resp.status == 303


async def test_actions_need_the_sessions_csrf_token_and_change_the_store_through_the_service(
        make_proxy, store_url, browser, http, tmp_path):
    proxy = await make_proxy(store_url, **hook_sections(tmp_path))
    await crashed_and_resumed(http, proxy)
    kid = await quarantined_kid(proxy)
    async with await login(browser, proxy):
        pass
    resolve = f"{proxy.url}/ui/journal/{kid}/resolve"
    for form in ({"action": "retry"}, {"action": "retry", "csrf": "guessed"}):
        async with browser.post(resolve, data=form, allow_redirects=False) as resp:
            assert resp.status == 403 and (await resp.json(content_type=None))["type"].endswith("/invalid-csrf")
        async with browser.post(resolve, data=form, headers=HTML, allow_redirects=False) as resp:
            assert resp.status == 403 and "CSRF" in await resp.text()  # a page, for a browser
    assert (await proxy.store.journal.get(kid)).state == EntryState.UNKNOWN  # refused: nothing changed

    async with browser.get(f"{proxy.url}/ui/journal/{kid}") as resp:
        page = await resp.text()
    csrf = csrf_of(page)
    async with browser.post(resolve, data={"csrf": csrf, "action": "respond", "status": "99"}, headers=HTML) as resp:
        assert resp.status == 400 and "status must be" in await resp.text()
    async with browser.post(resolve, allow_redirects=False, data={
            "csrf": csrf, "action": "respond", "status": "202", "headers": "Content-Type: application/json",
            "body": '{"sent": true}', "back": "https://evil.example/"}) as resp:
        assert resp.status == 303 and resp.headers["Location"] == f"/ui/journal/{kid}?done=responded"
    entry = await proxy.store.journal.get(kid)
    assert (entry.state, entry.response.status, entry.response.body) == (EntryState.COMPLETE, 202, b'{"sent": true}')

    await buried(http, proxy)
    async with browser.get(f"{proxy.url}/ui/quarantine") as resp:
        page = await resp.text()
    async with browser.post(f"{proxy.url}/ui/runs/{DEAD_RUN}/revive", allow_redirects=False,
                            data={"csrf": csrf_of(page), "namespace": "default", "back": "/ui/quarantine"}) as resp:
        assert resp.status == 303 and resp.headers["Location"] == "/ui/quarantine?done=revived"
    [run] = await proxy.store.runs.find("default", DEAD_RUN)
    assert (run.state, run.epoch) == (RunState.RESTARTING, 1)


async def test_the_run_page_shows_each_attempt_live_replayed_and_where_it_stopped(
        make_proxy, store_url, browser, http, tmp_path):
    proxy = await make_proxy(store_url, **hook_sections(tmp_path), upstreams__openai={
        "prices": {"gpt-4o-mini": [0.15, 0.60]}})
    await crashed_and_resumed(http, proxy)
    async with await login(browser, proxy):
        pass
    async with browser.get(f"{proxy.url}/ui/runs/{RUN}?namespace=default") as resp:
        assert resp.status == 200
        page = await resp.text()
    first, second = page.split('<section class="attempt')[1:3]
    outcomes = [re.findall(r'<span class="tag (\w+)">', s.split("<tbody>")[1]) for s in (first, second)]
    assert outcomes[0] == ["live"] * 4
    assert outcomes[1] == ["replayed"] * 4 + ["live"] * 2 + ["quarantined"]  # the replayed prefix first
    assert "Stopped after step 4" in text(first)
    assert "restarted by admin:token:" in text(first)  # the operator, by their token's fingerprint
    assert "attempt log" in page and "hook-exit" in page
    assert "gpt-4o-mini" in second and "from journal" in second and "$0.0000" in second
    assert QUARANTINED_KEY in second and "email-invoice-41" in second

    log = re.search(r'href="(/ui/runs/billing-agent/log/\d+\?namespace=default)"', page).group(1)
    async with browser.get(proxy.url + log) as resp:
        assert resp.status == 200 and "agent attempt started" in await resp.text()
    async with browser.get(f"{proxy.url}/ui/runs/{RUN}/log/0?namespace=default", headers=HTML) as resp:
        assert resp.status == 404  # an event that names no log file

    [run] = await proxy.store.runs.find("default", RUN)  # running, or restarting till its beats are flushed
    async with browser.get(f"{proxy.url}/ui/runs?state={run.state}&q=billing") as resp:
        listing = text(await resp.text())
    assert RUN in listing and run.state in listing
    async with browser.get(f"{proxy.url}/ui/runs?state=dead") as resp:
        assert RUN not in text(await resp.text())
    async with browser.get(f"{proxy.url}/ui/runs?q=nothing-like-it") as resp:
        assert RUN not in text(await resp.text())
    async with browser.get(f"{proxy.url}/ui/savings") as resp:
        savings = await resp.text()
    assert "Tokens saved by replays" in savings and '<rect class="bar"' in savings


async def test_the_entry_page_shows_key_fingerprint_headers_and_body(make_proxy, sqlite_url, browser, http,
                                                                     tmp_path):
    proxy = await make_proxy(sqlite_url, **hook_sections(tmp_path))
    await crashed_and_resumed(http, proxy)
    async with await login(browser, proxy):
        pass
    streamed = [e for e in await proxy.store.journal.search(run=RUN) if e.upstream == "openai" and e.epoch == 1]
    async with browser.get(f"{proxy.url}/ui/journal/{streamed[0].kid}") as resp:
        page = await resp.text()
    assert streamed[0].fingerprint in page and "derived by the proxy" in page
    assert "server-sent events, one per line" in page and "[DONE]" in page
    assert page.count('<span class="line">') == 7  # five chunks, the usage event, [DONE]
    async with browser.post(f"{proxy.url}/runs/x/tools/send", json={},
                            headers={"Idempotency-Key": "<script>alert(1)</script>"}) as resp:
        assert resp.status == 200
    [hostile] = await proxy.store.journal.search(run="x")
    async with browser.get(f"{proxy.url}/ui/journal/{hostile.kid}") as resp:
        page = await resp.text()
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    async with browser.get(f"{proxy.url}/ui/no-such-page", headers=HTML) as resp:
        assert resp.status == 404
    async with browser.get(f"{proxy.url}/ui", allow_redirects=False) as resp:
        assert resp.status == 303 and resp.headers["Location"] == "/ui/runs"
