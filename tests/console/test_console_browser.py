"""The console in a real browser: Debian's headless Chromium, driven by selenium through
its chromedriver, against a proxy on a real socket with real traffic (a run that crashed
and resumed, a quarantined tool call, a dead run).

It logs in, opens every page, resolves the quarantined call and revives the dead run
through the pages (and checks the store changed), and saves a 1280x800 screenshot of each
page; then what an operator needs besides: a completed run's quarantined
call marked and decided from its timeline, the navigation's count, an MCP step by its tool,
the journal searched by key, runs by namespace, and every page in dark mode. The
screenshots are kept in tests/artifacts/console/<test> (gitignored), or under
``$IDEMPROXY_SCREENSHOTS`` when set; the folder is printed (``pytest -s``).
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from console_traffic import (DEAD_RUN, MCP_RUN, MCP_TOOL, QUARANTINED_KEY, RUN, buried, crashed_and_resumed,
                             hook_sections, mcp_tool_call, quarantined_kid)
from idemproxy.proxy.store.model import EntryState, RunState
from mcp_tools import ToolServer

pytestmark = pytest.mark.slow  # a browser process and a dozen page loads

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts" / "console"


@pytest.fixture
def screenshots(request) -> Path:
    folder = Path(os.environ.get("IDEMPROXY_SCREENSHOTS") or ARTIFACTS) / request.node.name
    shutil.rmtree(folder, ignore_errors=True)  # this run's screenshots only
    folder.mkdir(parents=True, exist_ok=True)
    print(f"\nconsole screenshots: {folder}")
    return folder


@pytest.fixture
def chromium(tmp_path):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1280,800"):
        options.add_argument(flag)
    # the driver is named, so selenium's manager never looks for (or downloads) one
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    # the page's own viewport at 1280x800, as a person's window shows it (not the window's outer size)
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": 1280, "height": 800, "deviceScaleFactor": 1, "mobile": False})
    yield driver
    driver.quit()


def _left(element) -> bool:
    """Whether ``element``'s page has been replaced. Mid-navigation, chromedriver may say so not
    with a stale reference (all that ``staleness_of`` knows) but with an inspector error: the
    node "does not belong to the document" (seen with Chromium 156, one run in about ten)."""
    try:
        element.is_enabled()
    except StaleElementReferenceException:
        return True
    except WebDriverException as exc:
        if "does not belong to the document" in str(exc):
            return True
        raise
    return False


class Page:
    """The browser, driven from a thread so the proxy's event loop keeps answering."""

    def __init__(self, driver, base: str, screenshots: Path):
        self.driver, self.base, self.screenshots = driver, base, screenshots

    async def do(self, fn, *args):
        return await asyncio.to_thread(fn, *args)

    async def open(self, path: str) -> None:
        await self.do(self.driver.get, self.base + path)

    async def shot(self, name: str) -> Path:
        """A 1280x800 screenshot of the viewport as a person first sees the page."""
        path = self.screenshots / f"{name}.png"
        assert await self.do(self.driver.save_screenshot, str(path))
        return path

    async def text(self) -> str:
        return await self.do(lambda: self.driver.find_element(By.TAG_NAME, "body").text)

    async def click(self, css: str) -> None:
        await self.do(lambda: self.driver.find_element(By.CSS_SELECTOR, css).click())

    async def submit(self, css: str) -> None:
        """Click a button that loads another page, and wait until it has."""
        def click_and_wait():
            old = self.driver.find_element(By.TAG_NAME, "html")
            self.driver.find_element(By.CSS_SELECTOR, css).click()
            wait = WebDriverWait(self.driver, 15)
            wait.until(lambda _: _left(old))
            wait.until(lambda d: d.execute_script("return document.readyState") == "complete")
        await self.do(click_and_wait)

    async def type(self, css: str, value: str) -> None:
        def fill():
            field = self.driver.find_element(By.CSS_SELECTOR, css)
            field.clear()
            field.send_keys(value)
        await self.do(fill)

    @property
    def path(self) -> str:
        return self.driver.current_url.removeprefix(self.base)


async def test_the_console_in_a_real_browser(make_proxy, sqlite_url, http, chromium, screenshots, tmp_path):
    proxy = await make_proxy(sqlite_url, **hook_sections(tmp_path),
                             upstreams__openai={"prices": {"gpt-4o-mini": [0.15, 0.60]}})
    await crashed_and_resumed(http, proxy)
    await buried(http, proxy)
    kid = await quarantined_kid(proxy)
    page = Page(chromium, proxy.url, screenshots)

    await page.open("/ui/runs")  # no session: the login page
    assert page.path.startswith("/ui/login") and "Admin token" in await page.text()
    await page.shot("01-login")
    await page.type("#token", "test-admin-token")
    await page.submit("button.primary")
    assert page.path == "/ui/runs", await page.text()
    cookie = await page.do(chromium.get_cookie, "idemproxy_console")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and "test-admin-token" not in cookie["value"]
    listing = await page.text()
    assert RUN in listing and DEAD_RUN in listing and "dead" in listing
    await page.shot("02-runs")

    await page.open(f"/ui/runs/{RUN}?namespace=default")
    shown = await page.text()
    assert "Epoch 0" in shown and "Epoch 1" in shown and "Stopped after step 4" in shown
    assert "4 replayed" in shown and "2 live" in shown and "1 quarantined" in shown
    await page.shot("03-run-timeline")
    await page.do(chromium.execute_script, "document.querySelectorAll('.attempt')[1].scrollIntoView()")
    await page.shot("04-run-resumed-attempt")

    streamed = [e for e in await proxy.store.journal.search(run=RUN) if e.upstream == "openai" and e.epoch == 1]
    await page.open(f"/ui/journal/{streamed[0].kid}")
    assert "server-sent events, one per line" in await page.text()
    await page.shot("05-entry-stream")

    await page.open("/ui/quarantine")
    assert kid[:12] in await page.text()
    await page.shot("06-quarantine")
    await page.open(f"/ui/journal/{kid}")
    await page.shot("07-entry-quarantined")
    await page.click("#resolve details summary")  # respond with the answer the tool really gave
    await page.type("#resolve textarea[name=body]", '{"ok": true, "sent": "by hand"}')
    await page.shot("08-respond-form")
    await page.submit("#resolve form.respond button.primary")
    assert "Resolved: calls with this key now replay the answer you gave." in await page.text()
    entry = await proxy.store.journal.get(kid)
    assert (entry.state, entry.response.status) == (EntryState.COMPLETE, 200)
    assert entry.response.body == b'{"ok": true, "sent": "by hand"}'
    await page.shot("09-entry-resolved")

    await page.open("/ui/quarantine")
    await page.submit("table.grid form.inline button.primary")  # revive the dead run
    assert "Revived: a new attempt has started" in await page.text()
    [run] = await proxy.store.runs.find("default", DEAD_RUN)
    assert (run.state, run.epoch) == (RunState.RESTARTING, 1)
    await page.shot("10-quarantine-after")

    await page.open("/ui/savings")
    assert "Tokens saved by replays" in await page.text()
    await page.shot("11-savings")

    await page.submit("header.top .logout button")
    assert page.path.startswith("/ui/login")
    await page.open("/ui/runs")
    assert page.path.startswith("/ui/login")  # logged out
    assert len(list(screenshots.glob("*.png"))) == 11


async def test_what_an_operator_needs_in_a_real_browser_light_and_dark(make_proxy, sqlite_url, http, chromium,
                                                                     screenshots, tmp_path):
    tools = ToolServer(json_response=True)
    await tools.start()
    try:
        proxy = await make_proxy(sqlite_url, **hook_sections(tmp_path), upstreams__mcp={"url": tools.url, "kind": "mcp"},
                                 upstreams__openai={"prices": {"gpt-4o-mini": [0.15, 0.60]}})
        await crashed_and_resumed(http, proxy)
        await buried(http, proxy)
        await mcp_tool_call(http, proxy)
        async with http.post(f"{proxy.url}/runs/{RUN}/complete") as resp:  # done, one call still unknown
            assert resp.status == 200
        page = Page(chromium, proxy.url, screenshots)
        await page.open("/ui/login")
        await page.type("#token", "test-admin-token")
        await page.submit("button.primary")

        assert (await page.do(lambda: chromium.find_element(By.ID, "nav-quarantine").text)).split() == ["Quarantine", "2"]
        row = await page.do(lambda: chromium.find_element(
            By.XPATH, f"//tr[td/a[text()='{RUN}']]").text)
        assert "completed" in row and "1 quarantined" in row
        await page.shot("01-runs-marked")

        # dark mode while there is something to decide: the system's preference, as Chromium emulates it
        await page.do(chromium.execute_cdp_cmd, "Emulation.setEmulatedMedia",
                      {"features": [{"name": "prefers-color-scheme", "value": "dark"}]})
        for name, path in (("05-dark-runs", "/ui/runs"), ("06-dark-run", f"/ui/runs/{RUN}?namespace=default"),
                           ("07-dark-journal", "/ui/journal"), ("08-dark-quarantine", "/ui/quarantine")):
            await page.open(path)
            background = await page.do(chromium.execute_script,
                                       "return getComputedStyle(document.documentElement).backgroundColor")
            assert background == "rgb(15, 19, 27)", (path, background)
            if name == "06-dark-run":
                await page.do(chromium.execute_script,
                              "document.querySelector('tr.decide').scrollIntoView({block: 'center'})")
            await page.shot(name)
        await page.do(chromium.execute_cdp_cmd, "Emulation.setEmulatedMedia", {"features": []})

        await page.open(f"/ui/runs/{RUN}?namespace=default")
        assert "1 quarantined" in await page.do(lambda: chromium.find_element(By.TAG_NAME, "h1").text)
        times = await page.do(chromium.execute_script, """return [...document.querySelectorAll('.attempt')[1]
            .querySelectorAll('tr[data-at]')].map(r => parseFloat(r.dataset.at))""")
        assert len(times) == 7 and times == sorted(times)
        await page.do(chromium.execute_script, "document.querySelector('tr.decide').scrollIntoView({block: 'center'})")
        decide = await page.do(lambda: chromium.find_element(By.CSS_SELECTOR, "tr.decide").text)
        assert "upstream answered 503" in decide and "Retry" in decide
        await page.shot("02-run-quarantined-step")
        await page.click("tr.decide details summary")
        await page.type("tr.decide textarea[name=body]", '{"sent": true}')
        await page.submit("tr.decide form.respond button.primary")
        assert page.path == f"/ui/runs/{RUN}?namespace=default&done=responded"
        assert (await proxy.store.journal.get(await quarantined_kid(proxy))).state == EntryState.COMPLETE
        assert (await page.do(lambda: chromium.find_element(By.ID, "nav-quarantine").text)).split() == ["Quarantine", "1"]

        await page.open(f"/ui/runs/{MCP_RUN}?namespace=default")
        assert f"tools/call {MCP_TOOL}" in await page.do(lambda: chromium.find_element(By.CSS_SELECTOR, "td.path").text)
        await page.shot("03-mcp-step")

        await page.open("/ui/journal")
        await page.type("input[name=key]", QUARANTINED_KEY)
        await page.submit("form.filters button")
        found = await page.do(lambda: chromium.find_element(By.ID, "journal-entries").text)
        assert QUARANTINED_KEY in found and len(found.splitlines()) == 2
        await page.shot("04-journal-by-key")

        await page.open("/ui/runs")
        await page.type("input[name=namespace]", "default")
        await page.do(lambda: chromium.find_element(By.CSS_SELECTOR, "select[name=since] option[value='1h']").click())
        await page.submit("form.filters button")
        assert "namespace=default" in page.path and "since=1h" in page.path
        assert DEAD_RUN in await page.text()

        await page.open(f"/ui/runs/{DEAD_RUN}?namespace=default")
        assert "the run is dead" in await page.text()
        await page.submit("form.inline button.primary")  # revive
        restarts = await page.do(lambda: chromium.find_element(By.ID, "restarts").text)
        assert restarts.startswith("0 of 0 allowed") and "1 in all" in restarts

        light = await page.do(chromium.execute_script,
                              "return getComputedStyle(document.documentElement).backgroundColor")
        assert light == "rgb(246, 247, 249)"  # and light again, as the system asks
        assert len(list(screenshots.glob("*.png"))) == 8
    finally:
        await tools.stop()


async def test_refused_calls_under_their_attempt_in_a_real_browser(make_proxy, sqlite_url, http, chromium,
                                                                   screenshots, tmp_path):
    """A crashed and resumed run whose dead attempt's zombie keeps calling (412), whose new
    attempt reuses a key with another body (422) and calls an upstream that is down (502)."""
    proxy = await make_proxy(sqlite_url, **hook_sections(tmp_path),
                             upstreams__down={"url": "http://127.0.0.1:9", "kind": "tool"})
    await crashed_and_resumed(http, proxy)
    zombie, current = f"{proxy.url}/runs/{RUN}/epochs/0", f"{proxy.url}/runs/{RUN}/epochs/1"
    for path, body, key, status in ((f"{zombie}/tools/send", {"to": "carl"}, "late-1", 412),
                                    (f"{zombie}/openai/v1/chat/completions", {"model": "m", "messages": []}, None, 412),
                                    (f"{current}/tools/send", {"to": "ann", "invoice": 99}, "email-invoice-41", 422),
                                    (f"{current}/down/ledger", {"entry": 7}, "ledger-7", 502)):
        headers = {"Idempotency-Key": key} if key else {}
        async with http.post(path, json=body, headers=headers) as resp:
            assert resp.status == status, await resp.text()
    page = Page(chromium, proxy.url, screenshots)
    await page.open("/ui/login")
    await page.type("#token", "test-admin-token")
    await page.submit("button.primary")
    await page.open(f"/ui/runs/{RUN}?namespace=default")
    assert (await page.do(lambda: chromium.find_element(By.ID, "refused").text)).startswith("4")
    await page.shot("00-run-with-refusals")
    refused = await page.do(lambda: [row.text for row in chromium.find_elements(By.CSS_SELECTOR, "#refused-0 tbody tr")])
    assert len(refused) == 2 and all("412 stale-epoch" in row for row in refused), refused
    refused = await page.do(lambda: [row.text for row in chromium.find_elements(By.CSS_SELECTOR, "#refused-1 tbody tr")])
    assert ["422 key-reused" in refused[0], "502 upstream-unavailable" in refused[1]] == [True, True], refused
    await page.do(chromium.execute_script, "document.getElementById('refused-0').scrollIntoView()")
    await page.shot("01-refused-in-the-crashed-attempt")
    await page.do(chromium.execute_script, "document.getElementById('refused-1').scrollIntoView()")
    await page.shot("02-refused-in-the-resumed-attempt")
