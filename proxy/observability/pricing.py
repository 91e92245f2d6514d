"""What a model call cost, for the cost its replays saved (``idemproxy_cost_saved_usd_total``).

Prices come from genai-prices, the price database pydantic maintains per provider and
model (cache reads and writes priced apart); ``[upstreams.x] prices`` overrides it per model
(or ``"*"``), for a negotiated rate or a model the database does not know.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType
from urllib.parse import urlsplit

from ..config import UpstreamSettings

log = logging.getLogger("idemproxy.proxy")

# genai-prices' provider ids, by API host; another host is looked up by the upstream's name
PROVIDER_IDS = {"api.openai.com": "openai", "api.anthropic.com": "anthropic",
                "generativelanguage.googleapis.com": "google", "api.mistral.ai": "mistral",
                "api.groq.com": "groq", "api.deepseek.com": "deepseek", "api.together.xyz": "together",
                "api.x.ai": "x-ai"}


def cost_usd(upstream: UpstreamSettings, model: str | None, tokens: dict[str, int]) -> float:
    """USD for ``tokens`` (a provider's ``usage`` fields) of ``model`` on ``upstream``; 0.0 when
    neither the configuration nor the database prices it."""
    if not tokens:
        return 0.0
    configured = upstream.prices.get(model or "*") or upstream.prices.get("*")
    if configured:
        return (input_tokens(tokens) * configured[0] + output_tokens(tokens) * configured[1]) / 1e6
    if model is None:
        return 0.0
    return _from_database(_provider_id(upstream), model, tokens)


def input_tokens(tokens: dict[str, int]) -> int:
    return tokens.get("prompt_tokens", tokens.get("input_tokens", 0))


def output_tokens(tokens: dict[str, int]) -> int:
    return tokens.get("completion_tokens", tokens.get("output_tokens", 0))


def load() -> None:
    """Import the database ahead of the first replay (~0.4 s; run it in a thread). Its data
    module is imported by the first lookup, unless ``get_snapshot`` has run before: here."""
    _database().data_snapshot.get_snapshot()


@functools.cache
def _database() -> ModuleType:
    import genai_prices  # lazily: the CLI's other commands need no prices

    return genai_prices


def _provider_id(upstream: UpstreamSettings) -> str:
    return PROVIDER_IDS.get(urlsplit(upstream.url).hostname or "", upstream.name)


def _from_database(provider: str, model: str, tokens: dict[str, int]) -> float:
    db = _database()
    pricer = _pricer(provider, model)
    if pricer is _UNPRICED:
        return 0.0
    # Anthropic counts cache reads and writes apart from input_tokens; genai-prices wants the
    # total input with the cached parts named (OpenAI's prompt_tokens already is the total).
    read, written = tokens.get("cache_read_input_tokens", 0), tokens.get("cache_creation_input_tokens", 0)
    usage = db.Usage(input_tokens=input_tokens(tokens) + read + written, output_tokens=output_tokens(tokens),
                     cache_read_tokens=read or None, cache_write_tokens=written or None)
    return float(db.calc_price(usage, model, provider_id=pricer).total_price)


_UNPRICED = "<unpriced>"


@functools.lru_cache(maxsize=1024)
def _pricer(provider: str, model: str) -> str | None:
    """The provider id the database prices ``model`` under: ``provider``, else None (any
    provider that knows it), else ``_UNPRICED``. Remembered, misses too: genai-prices keeps
    what it found but not what it did not, and a model it does not know costs a scan of every
    provider's every model (~1,200 Python calls, 0.5-1 ms) per lookup. Bounded: agents name
    models."""
    db = _database()
    for provider_id in (provider, None):
        try:
            db.calc_price(db.Usage(input_tokens=0, output_tokens=0), model, provider_id=provider_id)
            return provider_id
        except LookupError:
            continue
    log.debug("no price for model %r (provider %s)", model, provider)
    return _UNPRICED
