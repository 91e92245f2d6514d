"""What an operator needs from the console, over HTTP against real traffic:
quarantined calls marked on their run and counted in the navigation, decided from the run's
timeline; MCP steps by their tool; replay times that never run backwards; refusals said to
be counted elsewhere; a journal browser; runs by namespace and time, a page at a time;
restarts counted as the supervisor counts them after a revive. The browser's view of the
same is in test_console_browser.py."""

from __future__ import annotations

import re
import time

from console_traffic import (DEAD_RUN, MCP_RUN, MCP_TOOL, QUARANTINED_KEY, RUN, buried, crashed_and_resumed,
                             hook_sections, mcp_tool_call, quarantined_kid)
from idemproxy.proxy.config import RunSettings
from idemproxy.proxy.store.model import EntryState, Run, RunState
from test_console import browser, csrf_of, login, text  # noqa: F401 - the fixture, shared
from mcp_tools import ToolServer


async def logged_in(browser, proxy) -> None:
    async with await login(browser, proxy) as resp:
        assert resp.status == 303


async def page_of(browser, url: str) -> str:
    async with browser.get(url) as resp:
        assert resp.status == 200, (url, resp.status, await resp.text())
        return await resp.text()


async def test_quarantined_calls_are_marked_on_their_run_counted_and_decided_from_the_timeline(
        make_proxy, sqlite_url, browser, http, tmp_path):
    proxy = await make_proxy(sqlite_url, **hook_sections(tmp_path))
    await crashed_and_resumed(http, proxy)
    await buried(http, proxy)
    async with http.post(f"{proxy.url}/runs/{RUN}/complete") as resp:  # the agent finished; one call is unknown
        assert resp.status == 200, await resp.text()
    await logged_in(browser, proxy)

    listing = await page_of(browser, f"{proxy.url}/ui/runs")
    row = next(r for r in listing.split("<tr>") if f">{RUN}</a>" in r)
    assert 'badge completed">completed' in row and "1 quarantined" in text(row)
    nav = re.search(r'<a href="/ui/quarantine" id="nav-quarantine".*?</a>', listing, re.S).group(0)
    assert re.search(r'class="count alert"[^>]*>2</span>', nav), nav  # one unknown call, one dead run
    assert "1 call with an unknown outcome, 1 dead run" in nav

    run_url = f"/ui/runs/{RUN}?namespace=default"
    page = await page_of(browser, proxy.url + run_url)
    assert 'id="run-quarantined"' in page and "1 quarantined" in text(page.split("</h1>")[0])
    decide = re.search(r'<tr class="quarantined decide">.*?</tr>', page, re.S).group(0)
    assert "upstream answered 503" in decide and "Retry" in decide and "Respond" in decide
    assert "outcome unknown · replays get 502" in text(page)
    kid = await quarantined_kid(proxy)
    async with browser.post(f"{proxy.url}/ui/journal/{kid}/resolve", allow_redirects=False, data={
            "csrf": csrf_of(page), "action": "retry", "back": run_url}) as resp:
        assert resp.status == 303 and resp.headers["Location"] == run_url + "&done=retried"
    retried = await proxy.store.journal.get(kid)  # the next call goes upstream again
    assert retried is None or retried.state != EntryState.UNKNOWN
    listing = await page_of(browser, f"{proxy.url}/ui/runs")
    assert "quarantined" not in text(next(r for r in listing.split("<tr>") if f">{RUN}</a>" in r))


async def test_replay_times_never_run_backwards_and_refusals_are_said_to_be_listed_apart(
        make_proxy, sqlite_url, browser, http, tmp_path):
    proxy = await make_proxy(sqlite_url, **hook_sections(tmp_path))
    await crashed_and_resumed(http, proxy)  # epoch 1's replays are counted after its live calls
    await logged_in(browser, proxy)
    page = await page_of(browser, f"{proxy.url}/ui/runs/{RUN}?namespace=default")
    resumed = page.split('<section class="attempt')[2]
    times = [float(t) for t in re.findall(r'data-at="([0-9.]+)"', resumed)]
    assert len(times) == 7 and times == sorted(times), times
    assert resumed.count("≤ ") == 4  # the replays' times: upper bounds
    said = " ".join(text(page).split())
    assert "409 conflict, 412 superseded epoch, 422 key reused, 502 upstream failed or outcome unknown) are no " \
           "steps: they are listed under their attempt" in said


async def test_an_mcp_step_shows_the_tool_it_called(make_proxy, sqlite_url, browser, http):
    tools = ToolServer(json_response=True)
    await tools.start()
    try:
        proxy = await make_proxy(sqlite_url, upstreams__mcp={"url": tools.url, "kind": "mcp"})
        await mcp_tool_call(http, proxy)
        [entry] = await proxy.store.journal.entries("default", MCP_RUN)
        assert entry.path == f"/mcp#{MCP_TOOL}"  # the tool, kept with the entry
        await logged_in(browser, proxy)
        page = await page_of(browser, f"{proxy.url}/ui/runs/{MCP_RUN}?namespace=default")
        assert f'<span class="method">tools/call</span> <strong class="tool">{MCP_TOOL}</strong>' in page
        assert "POST</span> /mcp" not in page
        entry_page = await page_of(browser, f"{proxy.url}/ui/journal/{entry.kid}")
        assert f"tools/call {MCP_TOOL} /mcp/mcp" in " ".join(text(entry_page).split())
    finally:
        await tools.stop()


async def test_a_revived_runs_restarts_count_from_the_revive_and_a_dead_run_reads_so(
        make_proxy, sqlite_url, browser, http, tmp_path):
    proxy = await make_proxy(sqlite_url, **hook_sections(tmp_path))
    await buried(http, proxy)
    await logged_in(browser, proxy)
    run_url = f"{proxy.url}/ui/runs/{DEAD_RUN}?namespace=default"
    page = text(await page_of(browser, run_url))
    assert "the run is dead" in page and "the run dead" not in page
    unexplained = Run.new("default", "died-before-endings", RunSettings(), time.time())
    unexplained.state = RunState.DEAD  # as runs that died before attempts' endings were recorded
    await proxy.store.runs.upsert(unexplained)
    page = " ".join(text(await page_of(browser, f"{proxy.url}/ui/runs/died-before-endings")).split())
    assert "No journaled steps in this attempt — the run is dead." in page
    async with browser.post(f"{proxy.url}/ui/runs/{DEAD_RUN}/revive", allow_redirects=False,
                            data={"csrf": csrf_of(await page_of(browser, run_url)), "namespace": "default"}) as resp:
        assert resp.status == 303
    [run] = await proxy.store.runs.find("default", DEAD_RUN)
    assert (run.restarts, run.max_restarts) == (1, 0)  # the revive counts in all, not against the rule
    restarts = re.search(r'<dd id="restarts">(.*?)</dd>', await page_of(browser, run_url), re.S).group(1)
    assert text(restarts).split() == "0 of 0 allowed in 600 s · 1 in all".split()


async def test_the_journal_page_finds_entries_by_key_kid_state_and_run(make_proxy, store_url, browser, http,
                                                                      tmp_path):
    proxy = await make_proxy(store_url, **hook_sections(tmp_path))
    await crashed_and_resumed(http, proxy)
    await logged_in(browser, proxy)
    everything = await page_of(browser, f"{proxy.url}/ui/journal")
    assert everything.count("<tr") == 1 + 7  # the head, and every entry of the run
    found = await page_of(browser, f"{proxy.url}/ui/journal?key={QUARANTINED_KEY}")
    kid = await quarantined_kid(proxy)
    assert found.count("<tr") == 2 and kid[:12] in found and f"/ui/journal/{kid}#resolve" in found
    assert (await page_of(browser, f"{proxy.url}/ui/journal?key={QUARANTINED_KEY}&run=another")).count("<tr") == 0
    quarantined = await page_of(browser, f"{proxy.url}/ui/journal?state=unknown")
    assert quarantined.count("<tr") == 2 and kid[:12] in quarantined
    by_run = await page_of(browser, f"{proxy.url}/ui/journal?run={RUN}&state=complete")
    assert by_run.count("<tr") == 1 + 6
    async with browser.get(f"{proxy.url}/ui/journal?kid={kid[:10]}", allow_redirects=False) as resp:
        assert resp.status == 303 and resp.headers["Location"] == f"/ui/journal/{kid}"
    assert "No journal entry matches" in await page_of(browser, f"{proxy.url}/ui/journal?key=no-such-key")


async def test_runs_are_filtered_by_namespace_and_time_and_paged_past_a_hundred(make_proxy, sqlite_url, browser):
    proxy = await make_proxy(sqlite_url)
    now = time.time()
    for i in range(130):  # run-000 oldest; 10 in another namespace; 5 not seen for two days
        namespace = "t:acme" if i % 13 == 0 else "default"
        seen = now - 2 * 86400 if i < 5 else now - i
        run = Run.new(namespace, f"run-{i:03d}", RunSettings(), seen)
        run.created_at = now - 1000 + i
        await proxy.store.runs.upsert(run)
    await logged_in(browser, proxy)

    def ids(page: str) -> list[str]:
        return re.findall(r'class="strong" href="/ui/runs/(run-\d+)\?', page)

    first = await page_of(browser, f"{proxy.url}/ui/runs")
    assert ids(first) == [f"run-{i:03d}" for i in range(129, 29, -1)]  # the newest hundred
    older = re.search(r'<a href="([^"]+)" rel="next">older', first).group(1).replace("&amp;", "&")
    second = await page_of(browser, proxy.url + older)
    assert ids(second) == [f"run-{i:03d}" for i in range(29, -1, -1)] and 'rel="next"' not in second
    assert 'rel="prev"' in second and "runs 101–130" in text(second)

    acme = await page_of(browser, f"{proxy.url}/ui/runs?namespace=t:acme")
    assert ids(acme) == [f"run-{i:03d}" for i in range(129, -1, -1) if i % 13 == 0]
    recent = await page_of(browser, f"{proxy.url}/ui/runs?since=24h")
    assert len(ids(recent)) == 100 and "run-004" not in recent
    recent_2 = await page_of(browser, f"{proxy.url}/ui/runs?since=24h&page=2")
    assert ids(recent_2) == [f"run-{i:03d}" for i in range(29, 4, -1)]
    both = await page_of(browser, f"{proxy.url}/ui/runs?since=24h&namespace=t:acme&state={RunState.RUNNING}")
    assert ids(both) == [f"run-{i:03d}" for i in range(129, 4, -1) if i % 13 == 0]
    async with browser.get(f"{proxy.url}/ui/runs?since=forever", headers={"Accept": "text/html"}) as resp:
        assert resp.status == 400


async def test_the_stylesheet_follows_the_systems_dark_mode(make_proxy, sqlite_url, http):
    proxy = await make_proxy(sqlite_url)
    async with http.get(f"{proxy.url}/ui/static/console.css") as resp:
        css = await resp.text()
    dark = css.split("@media (prefers-color-scheme: dark)", 1)[1]
    assert "--bg: #0f131b" in dark and "--card:" in dark
    # colours outside the variables would stay light in the dark: only the header's and badges' own
    light_only = re.findall(r"background: #(?:f|e)[0-9a-f]{5}", css.split("@media", 1)[0].split("}", 1)[1])
    assert light_only == [], light_only
