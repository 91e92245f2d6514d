"""Alerting (docs/operations.md#alerts): the gauges operators page on, and config/alerts.yaml.

promtool is not needed: the rules are read with pyyaml, and every metric (and label value)
their expressions name is looked for in what a real proxy exports at /metrics.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from conftest import backend_url
from idemproxy.proxy.appkeys import METRICS
from relay import Relay

ADMIN = {"Authorization": "Bearer test-admin-token"}
RULES = Path(__file__).resolve().parents[2] / "config" / "alerts.yaml"
SELECTOR = re.compile(r"\b(idemproxy_[a-z0-9_]+)(\{[^}]*\})?")
MATCHER = re.compile(r'([a-z_]+)\s*=\s*"([^"]*)"')
DURATION = re.compile(r"\d+[smhd]")


def samples(exposition: str) -> dict[str, list[dict[str, str]]]:
    """{metric name: [labels of each sample]} from the Prometheus text format."""
    found: dict[str, list[dict[str, str]]] = {}
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            found.setdefault(line.split()[2], [])
        elif line and not line.startswith("#"):
            name, _, rest = line.partition("{")
            name = name.split()[0]
            labels = dict(MATCHER.findall(rest.partition("}")[0])) if rest else {}
            found.setdefault(name, []).append(labels)
    return found


async def _scrape(http, proxy) -> str:
    async with http.get(f"{proxy.url}/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


def _value(exposition: str, name: str) -> float:
    (line,) = [line for line in exposition.splitlines() if line.startswith(name + " ")]
    return float(line.split()[1])


async def test_quarantined_entries_are_counted_from_the_store_when_scraped(make_proxy, store_url, http):
    proxy = await make_proxy(store_url)
    assert _value(await _scrape(http, proxy), "idemproxy_journal_quarantined") == 0
    for key in ("a", "b"):
        async with http.post(f"{proxy.url}/runs/r/tools/send", json={"to": key},
                             headers={"Idempotency-Key": key, "X-Fake-Status": "503"}) as resp:
            assert resp.status == 503
    async with http.post(f"{proxy.url}/runs/r/tools/send", json={"to": "a"},
                         headers={"Idempotency-Key": "a"}) as resp:
        assert resp.status == 502  # outcome-unknown
    proxy.app[METRICS].runs_counted_at = float("-inf")  # no wait for the next count
    exposition = await _scrape(http, proxy)
    assert _value(exposition, "idemproxy_journal_quarantined") == 2
    assert 'idemproxy_problems_total{type="outcome-unknown"} 1.0' in exposition
    assert 'idemproxy_runs{state="dead"} 0.0' in exposition  # dead runs: already a gauge

    async with http.get(f"{proxy.url}/admin/journal?state=quarantined", headers=ADMIN) as resp:
        found = await resp.json()
    async with http.post(f"{proxy.url}/admin/journal/{found['entries'][0]['kid']}/resolve", headers=ADMIN,
                         json={"action": "retry"}) as resp:
        assert resp.status == 200
    proxy.app[METRICS].runs_counted_at = float("-inf")
    assert _value(await _scrape(http, proxy), "idemproxy_journal_quarantined") == 1


async def test_upstream_timeouts_are_counted_by_problem_type(make_proxy, sqlite_url, http):
    proxy = await make_proxy(sqlite_url, upstreams__tools={"read_timeout": "0.2s"})
    async with http.post(f"{proxy.url}/runs/r/tools/send", json={"to": "ann"},
                         headers={"Idempotency-Key": "slow", "X-Fake-Delay": "1"}) as resp:
        assert resp.status == 504
    exposition = await _scrape(http, proxy)
    assert 'idemproxy_problems_total{type="upstream-timeout"} 1.0' in exposition
    assert 'idemproxy_problems_total{type="store-unavailable"} 0.0' in exposition
    assert _value(exposition, "idemproxy_journal_quarantined") == 1  # a tool: the timeout is quarantined


async def test_a_store_that_does_not_answer_is_counted(make_proxy, http, tmp_path):
    url, cleanup = backend_url("redis", tmp_path)
    relay = await Relay(urlsplit(url).port).up()  # the store, reached through a relay we take away
    try:
        proxy = await make_proxy(url.replace(f":{urlsplit(url).port}", f":{relay.port}", 1), store={"timeout": "0.5s"})
        await relay.down()
        async with http.post(f"{proxy.url}/runs/r/tools/send", json={"to": "ann"},
                             headers={"Idempotency-Key": "k"}) as resp:
            assert resp.status == 503
        exposition = await _scrape(http, proxy)
        assert 'idemproxy_problems_total{type="store-unavailable"} 1.0' in exposition
    finally:
        await relay.down()
        await asyncio.to_thread(cleanup)


async def test_every_alert_names_metrics_the_proxy_exports(make_proxy, sqlite_url, http):
    rules = yaml.safe_load(RULES.read_text())
    proxy = await make_proxy(sqlite_url)
    exported = samples(await _scrape(http, proxy))
    alerts = [rule for group in rules["groups"] for rule in group["rules"]]
    names = {rule["alert"] for rule in alerts}
    assert {"IdemproxyQuarantinedCallsWaiting", "IdemproxyDeadRuns", "IdemproxyStoreUnavailable",
            "IdemproxyUpstreamTimeouts"} <= names
    assert len(names) == len(alerts)
    for rule in alerts:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert DURATION.fullmatch(rule.get("for", "0s")), rule
        assert rule["labels"]["severity"] in ("page", "warning")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        selectors = SELECTOR.findall(rule["expr"])
        assert selectors, f"{rule['alert']} names no idemproxy metric"
        for name, matchers in selectors:
            assert name in exported, f"{rule['alert']}: {name} is not exported"
            for label, value in MATCHER.findall(matchers):
                assert any(s.get(label) == value for s in exported[name]), \
                    f"{rule['alert']}: no {name}{{{label}=\"{value}\"}} series"
    quarantined = next(r for r in alerts if r["alert"] == "IdemproxyQuarantinedCallsWaiting")
    assert "idemproxy_journal_quarantined" in quarantined["expr"] and quarantined["for"] == "5m"
