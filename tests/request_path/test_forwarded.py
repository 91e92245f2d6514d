"""X-Forwarded-For and Forwarded: the real peer is appended, and what a
request claims about earlier hops is kept only from a trusted proxy."""

from __future__ import annotations

import pytest

from idemproxy.proxy.config import ConfigError, load_settings
from config_files import write_config

CLAIMS = {"X-Forwarded-For": "203.0.113.7", "Forwarded": "for=203.0.113.7;proto=https",
          "X-Forwarded-Host": "bank.example", "X-Forwarded-Proto": "https", "X-Real-IP": "203.0.113.7"}


async def seen_upstream(http, proxy, method: str, headers: dict) -> dict:
    """The headers the upstream got (the fake provider's /echo), for a passthrough GET or a
    recorded POST."""
    extra = {"Idempotency-Key": f"k-{len(headers)}-{method}"} if method == "POST" else {}
    async with http.request(method, proxy.url + "/raw/echo/x", headers={**headers, **extra}) as r:
        assert r.status == 200
        return {k.lower(): v for k, v in (await r.json())["headers"].items()}


@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_an_untrusted_peers_claims_are_replaced_by_the_peer(make_proxy, sqlite_url, http, method):
    proxy = await make_proxy(sqlite_url)
    seen = await seen_upstream(http, proxy, method, CLAIMS)
    assert seen["x-forwarded-for"] == "127.0.0.1"
    assert seen["forwarded"] == "for=127.0.0.1"
    assert not {"x-forwarded-host", "x-forwarded-proto", "x-real-ip"} & set(seen)


@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_a_trusted_proxys_claims_are_kept_and_the_peer_appended(make_proxy, sqlite_url, http, method):
    proxy = await make_proxy(sqlite_url, server={"trusted_proxies": ["127.0.0.0/8"]})
    seen = await seen_upstream(http, proxy, method, CLAIMS)
    assert seen["x-forwarded-for"] == "203.0.113.7, 127.0.0.1"
    assert seen["forwarded"] == "for=203.0.113.7;proto=https, for=127.0.0.1"
    assert (seen["x-forwarded-host"], seen["x-forwarded-proto"]) == ("bank.example", "https")


async def test_a_request_without_claims_names_its_peer(make_proxy, sqlite_url, http):
    proxy = await make_proxy(sqlite_url)
    seen = await seen_upstream(http, proxy, "GET", {})
    assert seen["x-forwarded-for"] == "127.0.0.1" and "forwarded" not in seen


def test_trusted_proxies_must_be_networks(tmp_path):
    path = write_config(tmp_path / "c.toml", {"server": {"trusted_proxies": ["10.0.0.0/8", "nonsense"]}})
    with pytest.raises(ConfigError, match="trusted_proxies"):
        load_settings(path, env={})
