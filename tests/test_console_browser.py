"""The console in a real browser: Debian's headless Chromium, driven by selenium through
its chromedriver, against a proxy on a real socket with real traffic (a run that crashed
and resumed, a quarantined tool call, a dead run).

It logs in, opens every page, resolves the quarantined call and revives the dead run
through the pages (and checks the store changed), and saves a 1280x800 screenshot of each
page. The screenshots' folder is printed (``pytest -s``) and kept under pytest's temporary
directory, or under ``$IDEMPROXY_SCREENSHOTS`` when set.
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

from console_traffic import DEAD_RUN, RUN, buried, crashed_and_resumed, hook_sections, quarantined_kid
from idemproxy.proxy.store.base import EntryState, RunState

pytestmark = pytest.mark.slow  # a browser process and a dozen page loads

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


@pytest.fixture
def screenshots(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("IDEMPROXY_SCREENSHOTS") or tmp_path_factory.mktemp("console-screenshots"))
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
