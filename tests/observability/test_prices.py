"""Cost saved from a maintained price database: genai-prices prices real
models; ``[upstreams.x] prices`` overrides it; the counters carry a ``model`` label."""

from __future__ import annotations

import asyncio

import pytest
from genai_prices import Usage, calc_price

from idemproxy.proxy.config import UpstreamSettings
from idemproxy.proxy.observability.metrics import PRICE_WHEN_QUIET_S
from idemproxy.proxy.observability.pricing import cost_usd

OPENAI = "/openai/v1/chat/completions"
ANTHROPIC = "/anthropic/v1/messages"


async def replay_twice(http, url: str, body: dict, key: str) -> None:
    for _ in range(3):  # one recorded call, two replays
        async with http.post(url, json=body, headers={"Idempotency-Key": key}) as resp:
            assert resp.status == 200


async def scrape(http, proxy) -> dict[str, float]:
    async with http.get(proxy.url + "/metrics") as resp:
        text = await resp.text()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(("idemproxy_tokens_saved_total", "idemproxy_cost_saved_usd_total"))}


async def test_replays_of_real_models_are_priced_from_the_database(make_proxy, sqlite_url, http):
    proxy = await make_proxy(sqlite_url)
    await replay_twice(http, proxy.url + OPENAI, {"model": "gpt-4o-mini", "messages": []}, "a")
    await replay_twice(http, proxy.url + ANTHROPIC,
                       {"model": "claude-sonnet-4-20250514", "max_tokens": 9, "messages": []}, "b")
    metrics = await scrape(http, proxy)
    # the fake provider reports 10 prompt + 5 completion tokens (OpenAI), 12 + 6 (Anthropic)
    gpt = float(calc_price(Usage(input_tokens=10, output_tokens=5), "gpt-4o-mini", provider_id="openai")
                .total_price)
    claude = float(calc_price(Usage(input_tokens=12, output_tokens=6), "claude-sonnet-4-20250514",
                              provider_id="anthropic").total_price)
    assert gpt > 0 and claude > gpt
    assert metrics['idemproxy_cost_saved_usd_total{model="gpt-4o-mini",upstream="openai"}'] == \
        pytest.approx(2 * gpt)
    assert metrics['idemproxy_cost_saved_usd_total{model="claude-sonnet-4-20250514",upstream="anthropic"}'] == \
        pytest.approx(2 * claude)
    assert metrics['idemproxy_tokens_saved_total{kind="prompt_tokens",model="gpt-4o-mini",upstream="openai"}'] == 20
    assert metrics['idemproxy_tokens_saved_total{kind="output_tokens",model="claude-sonnet-4-20250514",'
                   'upstream="anthropic"}'] == 12


async def test_configured_prices_override_the_database(make_proxy, sqlite_url, http):
    proxy = await make_proxy(sqlite_url, upstreams__openai={"prices": {"gpt-4o-mini": [1000.0, 2000.0]}})
    await replay_twice(http, proxy.url + OPENAI, {"model": "gpt-4o-mini", "messages": []}, "c")
    metrics = await scrape(http, proxy)
    # 2 replays x (10 x 1000 + 5 x 2000) / 1e6
    assert metrics['idemproxy_cost_saved_usd_total{model="gpt-4o-mini",upstream="openai"}'] == \
        pytest.approx(0.04)


def test_anthropic_cache_tokens_are_priced_at_their_own_rates():
    up = UpstreamSettings("anthropic", "https://api.anthropic.com")
    plain = cost_usd(up, "claude-sonnet-4-20250514", {"input_tokens": 100, "output_tokens": 10})
    cached = cost_usd(up, "claude-sonnet-4-20250514", {"input_tokens": 100, "output_tokens": 10,
                                                       "cache_read_input_tokens": 100_000})
    # 100k cache reads at a tenth of the input price ($3/M): 3 cents more, not 30
    assert cached - plain == pytest.approx(0.03)


def test_a_model_nobody_prices_costs_nothing_rather_than_a_guess():
    up = UpstreamSettings("tools", "http://127.0.0.1:9")
    assert cost_usd(up, "no-such-model-anywhere", {"prompt_tokens": 10}) == 0.0
    assert cost_usd(up, None, {"prompt_tokens": 10}) == 0.0


async def test_replays_before_and_after_a_scrape_are_each_priced_once(make_proxy, sqlite_url, http):
    """A key's price is looked up after its replay is answered (or when the metrics are
    read): replays on either side of that moment all count, none twice."""
    proxy = await make_proxy(sqlite_url, upstreams__openai={"prices": {"gpt-4o-mini": [1000.0, 2000.0]}})
    url, body = proxy.url + OPENAI, {"model": "gpt-4o-mini", "messages": []}
    await replay_twice(http, url, body, "d")  # recorded, then two replays
    first = await scrape(http, proxy)
    async with http.post(url, json=body, headers={"Idempotency-Key": "d"}) as resp:
        assert resp.status == 200 and resp.headers["Idempotent-Replayed"] == "true"
    second = await scrape(http, proxy)
    label = 'idemproxy_cost_saved_usd_total{model="gpt-4o-mini",upstream="openai"}'
    assert first[label] == pytest.approx(0.04) and second[label] == pytest.approx(0.06)


async def test_a_burst_of_new_keys_is_priced_once_it_pauses(make_proxy, sqlite_url, http):
    """A restarted attempt replays hundreds of keys for the first time, one after the other:
    their prices are looked up once such replays pause, not between them (each lookup is
    0.2-0.5 ms of the event loop), and all of them then."""
    proxy = await make_proxy(sqlite_url)
    metrics, url = proxy.proxy.metrics, proxy.url + OPENAI
    for n in range(5):
        await replay_twice(http, url, {"model": "gpt-4o-mini", "messages": [], "n": n}, f"burst-{n}")
        await asyncio.sleep(0.01)  # turns of the event loop: a lookup scheduled per key would run
    assert len(metrics._unpriced) == 5
    await asyncio.sleep(PRICE_WHEN_QUIET_S + 0.2)
    assert not metrics._unpriced
    gpt = float(calc_price(Usage(input_tokens=10, output_tokens=5), "gpt-4o-mini", provider_id="openai")
                .total_price)
    assert (await scrape(http, proxy))['idemproxy_cost_saved_usd_total{model="gpt-4o-mini",upstream="openai"}'] \
        == pytest.approx(10 * gpt)
