"""What one client may try (proxy/ratelimit.py), over real sockets: wrong admin tokens on the
admin API and the console's login lock that client out (429, Retry-After) while others go
on; registrations that need no token are bounded per namespace and per client. Clients
are told apart by their real source address (127.0.0.2, 127.0.0.3: loopback aliases)."""

from __future__ import annotations

import re
import time

import aiohttp
import pytest

from rawhttp import problem

ADMIN = {"Authorization": "Bearer test-admin-token"}
WRONG = {"Authorization": "Bearer not-the-admin-token"}


@pytest.fixture
async def client_at():
    """``client_at("127.0.0.2")``: a session whose connections come from that address."""
    sessions: list[aiohttp.ClientSession] = []

    def make(address: str) -> aiohttp.ClientSession:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(address, 0)),
                                        cookie_jar=aiohttp.CookieJar(unsafe=True))
        sessions.append(session)
        return session
    yield make
    for session in sessions:
        await session.close()


async def status_of(session, method: str, url: str, **kwargs) -> int:
    async with session.request(method, url, **kwargs) as resp:
        await resp.read()
        return resp.status


async def test_wrong_admin_tokens_lock_out_their_client_only(make_proxy, sqlite_url, client_at):
    proxy = await make_proxy(sqlite_url, admin={"max_failures": 5, "failure_window": "30s"})
    runs = f"{proxy.url}/admin/runs"
    attacker, operator = client_at("127.0.0.2"), client_at("127.0.0.3")
    started = time.monotonic()
    assert [await status_of(attacker, "GET", runs, headers=WRONG) for _ in range(5)] == [401] * 5
    for headers in (WRONG, ADMIN):  # locked: not even the right token is looked at
        async with attacker.get(runs, headers=headers) as resp:
            body = await problem(resp, "too-many-requests", 429)
            # counted in sixths of the window: a window may reach back up to one sixth further
            assert 1 <= int(resp.headers["Retry-After"]) <= 35 and body["retry_after"] >= 1
    statuses = [await status_of(attacker, "GET", runs, headers=WRONG) for _ in range(300)]
    assert set(statuses) == {429}  # 300 more tries, none of them compared
    assert time.monotonic() - started < 20
    # another client, meanwhile, is neither refused nor slowed
    began = time.monotonic()
    assert await status_of(operator, "GET", runs, headers=ADMIN) == 200
    assert time.monotonic() - began < 0.5


async def test_the_console_login_counts_against_the_same_client(make_proxy, sqlite_url, client_at):
    proxy = await make_proxy(sqlite_url, admin={"max_failures": 3})
    browser = client_at("127.0.0.2")

    async def log_in(token: str) -> aiohttp.ClientResponse:
        async with browser.get(f"{proxy.url}/ui/login") as resp:
            form = re.search(r'name="form" value="([0-9a-f]+)"', await resp.text()).group(1)
        return await browser.post(f"{proxy.url}/ui/login", data={"form": form, "token": token},
                                  allow_redirects=False, headers={"Accept": "text/html"})
    for _ in range(2):
        assert (await log_in("guess")).status == 401
    assert await status_of(browser, "GET", f"{proxy.url}/admin/runs", headers=WRONG) == 401  # the third
    locked = await log_in("test-admin-token")
    assert locked.status == 429 and "Retry-After" in locked.headers
    assert "too many wrong admin tokens" in await locked.text()
    other = client_at("127.0.0.3")
    async with other.get(f"{proxy.url}/ui/login") as resp:
        form = re.search(r'name="form" value="([0-9a-f]+)"', await resp.text()).group(1)
    async with other.post(f"{proxy.url}/ui/login", data={"form": form, "token": "test-admin-token"},
                          allow_redirects=False) as resp:
        assert resp.status == 303  # logged in


async def test_failures_from_every_client_together_hold_up_those_that_failed(make_proxy, sqlite_url, client_at):
    """A guesser spread over many addresses: past max_failures_total, each address that sent
    a wrong token waits; one that sent none is let in."""
    proxy = await make_proxy(sqlite_url, admin={"max_failures": 10, "max_failures_total": 3})
    runs = f"{proxy.url}/admin/runs"
    guessers = [client_at(f"127.0.0.{n}") for n in (2, 3, 4)]
    for guesser in guessers:
        assert await status_of(guesser, "GET", runs, headers=WRONG) == 401
    for guesser in guessers:
        assert await status_of(guesser, "GET", runs, headers=ADMIN) == 429
    assert await status_of(client_at("127.0.0.5"), "GET", runs, headers=ADMIN) == 200


async def test_clients_behind_a_trusted_proxy_are_told_apart_by_x_forwarded_for(make_proxy, sqlite_url, http):
    proxy = await make_proxy(sqlite_url, admin={"max_failures": 2},
                             server={"trusted_proxies": ["127.0.0.1/32"]})
    runs = f"{proxy.url}/admin/runs"
    one, two = {"X-Forwarded-For": "203.0.113.7"}, {"X-Forwarded-For": "198.51.100.9, 203.0.113.8"}
    for _ in range(2):
        assert await status_of(http, "GET", runs, headers={**WRONG, **one}) == 401
    assert await status_of(http, "GET", runs, headers={**ADMIN, **one}) == 429
    assert await status_of(http, "GET", runs, headers={**ADMIN, **two}) == 200


async def test_live_runs_per_namespace_are_capped(make_proxy, store_url, http):
    proxy = await make_proxy(store_url, runs={"max_live_runs": 3})
    for n in range(3):
        assert await status_of(http, "POST", f"{proxy.url}/runs/r{n}", json={"metadata": {"n": n}}) == 201
    async with http.post(f"{proxy.url}/runs/r3", json={}) as resp:
        body = await problem(resp, "too-many-runs", 429)
        assert body["max_live_runs"] == 3 and "max_live_runs" in body["detail"]
    async with http.post(f"{proxy.url}/runs/r3/attempts") as resp:
        await problem(resp, "too-many-runs", 429)  # an attempt of an unknown run would make one
    assert await status_of(http, "POST", f"{proxy.url}/runs/r0", json={"timeout_s": 30}) == 200  # an update
    assert await status_of(http, "POST", f"{proxy.url}/admin/runs/r9?namespace=default", headers=ADMIN,
                           json={}) == 201  # operators are not held to it
    for ended in ("r0", "r1"):  # r9 counts too: 4 live, 2 once these have ended
        assert await status_of(http, "POST", f"{proxy.url}/runs/{ended}/complete", json={"epoch": 0}) == 200
    assert await status_of(http, "POST", f"{proxy.url}/runs/r3", json={}) == 201  # room again
    assert len(await proxy.store.runs.list()) == 5


async def test_new_runs_per_minute_are_bounded_per_namespace_and_per_client(make_proxy, sqlite_url, client_at):
    proxy = await make_proxy(sqlite_url, runs={"registrations_per_minute": 4},
                             tenants={"runs": "credential", "anonymous": "shared"})
    flooder, neighbour = client_at("127.0.0.2"), client_at("127.0.0.3")
    key = {"Authorization": "Bearer sk-flooder"}
    codes = [await status_of(flooder, "POST", f"{proxy.url}/runs/f{n}", headers=key, json={}) for n in range(6)]
    assert codes == [201] * 4 + [429] * 2
    async with flooder.post(f"{proxy.url}/runs/f9", headers={"Authorization": "Bearer sk-another"}) as resp:
        body = await problem(resp, "too-many-requests", 429)  # another namespace, the same client
        assert 1 <= int(resp.headers["Retry-After"]) <= 70 and "a minute" in body["detail"]
    assert await status_of(flooder, "POST", f"{proxy.url}/runs/f0", headers=key, json={}) == 200  # not new
    assert await status_of(neighbour, "POST", f"{proxy.url}/runs/n0", headers={"Authorization": "Bearer sk-n"},
                           json={}) == 201
    async with neighbour.post(f"{proxy.url}/runs/n1", headers=key, json={}) as resp:
        await problem(resp, "too-many-requests", 429)  # the flooder's namespace, from anywhere


async def test_the_limits_hold_across_replicas_over_one_store(make_proxy, store_url, client_at):
    """Two replicas over one store: a client that spreads its tries over both gets the budget
    once, not twice — wrong admin tokens and registrations alike."""
    settings = {"admin": {"max_failures": 4, "failure_window": "30s"}, "runs": {"registrations_per_minute": 4},
                "tenants": {"runs": "credential", "anonymous": "shared"}}
    replicas = [await make_proxy(store_url, **settings), await make_proxy(store_url, **settings)]
    attacker, operator = client_at("127.0.0.2"), client_at("127.0.0.3")
    tries = [await status_of(attacker, "GET", f"{replicas[n % 2].url}/admin/runs", headers=WRONG) for n in range(6)]
    assert tries == [401] * 4 + [429] * 2
    for replica in replicas:
        assert await status_of(attacker, "GET", f"{replica.url}/admin/runs", headers=ADMIN) == 429
        assert await status_of(operator, "GET", f"{replica.url}/admin/runs", headers=ADMIN) == 200
    key = {"Authorization": "Bearer sk-flooder"}
    codes = [await status_of(attacker, "POST", f"{replicas[n % 2].url}/runs/f{n}", headers=key, json={})
             for n in range(6)]
    assert codes == [201] * 4 + [429] * 2


async def test_wrong_tokens_and_registrations_sent_at_once_get_the_budget_once(make_proxy, store_url, client_at):
    """Tries sent together, each read of the counts before any write of one: a replica holds
    the tries it let through until their counts are written, so a burst gets max_failures
    wrong tokens compared (and registrations_per_minute new runs), not every one it sent."""
    import asyncio
    proxy = await make_proxy(store_url, admin={"max_failures": 3, "failure_window": "30s"},
                             runs={"registrations_per_minute": 3},
                             tenants={"runs": "credential", "anonymous": "shared"})
    attacker, operator = client_at("127.0.0.2"), client_at("127.0.0.3")
    tries = await asyncio.gather(*(status_of(attacker, "GET", f"{proxy.url}/admin/runs", headers=WRONG)
                                   for _ in range(40)))
    assert sorted(tries).count(401) == 3 and set(tries) == {401, 429}
    # an operator's requests at once are all let in: a right token holds nothing back
    assert set(await asyncio.gather(*(status_of(operator, "GET", f"{proxy.url}/admin/runs", headers=ADMIN)
                                      for _ in range(10)))) == {200}
    key = {"Authorization": "Bearer sk-flooder"}
    codes = await asyncio.gather(*(status_of(attacker, "POST", f"{proxy.url}/runs/b{n}", headers=key, json={})
                                   for n in range(30)))
    assert codes.count(201) == 3 and set(codes) == {201, 429}
    assert len(await proxy.store.runs.list()) == 3


async def test_new_runs_sent_at_once_stop_at_max_live_runs(make_proxy, store_url, http):
    """Registrations sent together: each new run is written before the next is judged against
    the namespace's live runs, so a burst does not each find room that the others take."""
    import asyncio
    proxy = await make_proxy(store_url, runs={"max_live_runs": 3})
    codes = await asyncio.gather(*(status_of(http, "POST", f"{proxy.url}/runs/c{n}", json={}) for n in range(20)))
    assert codes.count(201) == 3 and set(codes) == {201, 429}
    assert len(await proxy.store.runs.list()) == 3
