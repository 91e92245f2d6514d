"""Prometheus metrics: outcomes, latency, and what replays saved."""

from __future__ import annotations

import re

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .config import UpstreamSettings
from .store.base import Recorded

BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
           1, 2.5, 5, 10, 30, 60, 120)
USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "input_tokens", "output_tokens",
                "cache_read_input_tokens", "cache_creation_input_tokens")
MODEL = re.compile(rb'"model"\s*:\s*"([^"]{1,200})"')
STREAM_USAGE = re.compile(rb'"(' + b"|".join(f.encode() for f in USAGE_FIELDS) + rb')"\s*:\s*(\d+)')


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("idemproxy_requests_total", "Requests by outcome", ["outcome"], registry=r)
        self.upstream_latency = Histogram("idemproxy_upstream_seconds", "Upstream time to headers",
                                          buckets=BUCKETS, registry=r)
        self.overhead = Histogram("idemproxy_overhead_seconds", "The proxy's own time per request",
                                  buckets=BUCKETS, registry=r)
        self.cost_saved = Counter("idemproxy_cost_saved_usd_total", "Cost not paid again thanks to "
                                  "replays, from usage fields and the upstream's configured prices",
                                  ["upstream"], registry=r)
        self.tokens_saved = Counter("idemproxy_tokens_saved_total", "Tokens not paid again thanks to "
                                    "replays, from the providers' usage fields", ["upstream", "kind"],
                                    registry=r)
        self.runs = Gauge("idemproxy_runs", "Runs by state", ["state"], registry=r)
        self.restarts = Counter("idemproxy_restarts_total", "Runs restarted by the supervisor",
                                registry=r)
        self._by_outcome = {}

    def observe(self, outcome: str, total_s: float, upstream_s: float | None) -> None:
        counter = self._by_outcome.get(outcome)
        if counter is None:
            counter = self._by_outcome[outcome] = self.requests.labels(outcome)
        counter.inc()
        if upstream_s is not None:
            self.upstream_latency.observe(upstream_s)
            self.overhead.observe(max(0.0, total_s - upstream_s))
        elif outcome == "replayed" or outcome == "rejected":
            self.overhead.observe(total_s)

    def saved(self, upstream: UpstreamSettings, recorded: Recorded) -> None:
        """Count the tokens, and where prices are configured the cost, a replay did not pay again."""
        tokens = usage(recorded)
        for kind, n in tokens.items():
            self.tokens_saved.labels(upstream.name, kind).inc(n)
        if tokens and upstream.prices:
            price = upstream.prices.get(model_of(recorded) or "*") or upstream.prices.get("*")
            if price:
                spent_in = tokens.get("prompt_tokens", tokens.get("input_tokens", 0))
                spent_out = tokens.get("completion_tokens", tokens.get("output_tokens", 0))
                self.cost_saved.labels(upstream.name).inc((spent_in * price[0] + spent_out * price[1]) / 1e6)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def model_of(recorded: Recorded) -> str | None:
    """The model named in a recorded answer (JSON or SSE), for its price."""
    found = MODEL.search(recorded.body[:65536])
    return found.group(1).decode(errors="replace") if found else None


def usage(recorded: Recorded) -> dict[str, int]:
    body = recorded.body
    if not body or len(body) > 1 << 20 or any(k.lower() == "content-encoding" for k, _ in recorded.headers):
        return {}
    if recorded.streamed:  # SSE: usage arrives in the last events; take the largest seen
        found: dict[str, int] = {}
        for name, value in STREAM_USAGE.findall(body):
            found[name.decode()] = max(found.get(name.decode(), 0), int(value))
        return found
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return {}
    fields = doc.get("usage") if isinstance(doc, dict) else None
    if not isinstance(fields, dict):
        return {}
    return {k: v for k, v in fields.items() if k in USAGE_FIELDS and isinstance(v, int)}
