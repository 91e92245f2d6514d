"""Prometheus metrics: outcomes, latency, and what replays saved."""

from __future__ import annotations

import asyncio
import bisect
import re
import time

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from ..config import UpstreamSettings
from ..outcomes import Outcome
from ..problems import PROBLEMS
from ..store.model import RUN_STATES, Recorded
from .pricing import cost_usd

BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
           1, 2.5, 5, 10, 30, 60, 120)
# Outcomes with no upstream time: the whole request is the proxy's own time.
OWN_TIME_ONLY = frozenset({Outcome.REPLAYED, Outcome.REJECTED})
USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "input_tokens", "output_tokens",
                "cache_read_input_tokens", "cache_creation_input_tokens")
SAVINGS_CACHE = 4096  # keys whose savings are remembered between replays
# Replays of keys not priced yet come in bursts (a restarted attempt replays hundreds, one
# after the other): they are counted and priced once no new one has come for
# PRICE_WHEN_QUIET_S, so the work does not take the CPU from the burst; past PRICE_BACKLOG
# keys waiting, one per turn of the event loop at once.
PRICE_WHEN_QUIET_S = 0.25
HELD_BODY_BYTES = 65536  # larger answers are worked out at once: at most PRICE_BACKLOG small ones wait
PRICE_BACKLOG = 1000
MODEL = re.compile(rb'"model"\s*:\s*"([^"]{1,200})"')
STREAM_USAGE = re.compile(rb'"(' + b"|".join(f.encode() for f in USAGE_FIELDS) + rb')"\s*:\s*(\d+)')


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # Per-request counts are plain numbers, turned into Prometheus families when scraped:
        # a labelled Counter and two Histograms cost ~5 us of locking on every request.
        self._outcomes: dict[Outcome, int] = {}
        self._upstream = Buckets()
        self._overhead = Buckets()
        r.register(_RequestCollector(self))
        self._tokens_saved: dict[tuple[str, str, str], int] = {}  # (upstream, model, kind) -> tokens
        self._cost_saved: dict[tuple[str, str], float] = {}  # (upstream, model) -> USD
        self._savings: dict[str, tuple[str, dict[str, int], float]] = {}  # per key, worked out once
        # keys replayed whose savings are still to be worked out: [upstream, recorded, replays]
        self._unpriced: dict[str, list] = {}
        self._pricing: asyncio.Handle | None = None  # the next lookup, scheduled on the event loop
        self._new_key_at = 0.0  # time.monotonic() of the last key added to _unpriced
        self.replayed_from_memory = 0  # replays answered from an attempt's preloaded journal
        self.replayed_from_cache = 0  # replays answered from entries held here (answercache.py)
        self.runs = Gauge("idemproxy_runs", "Runs by state", ["state"], registry=r)
        # counted in the store when scraped, like the runs: every replica shows the same number
        self.quarantined = Gauge("idemproxy_journal_quarantined", "Journal entries whose outcome is "
                                 "unknown, waiting for an operator to resolve them", registry=r)
        # problem+json answers by type: store-unavailable and upstream-timeout are alerted on
        # (config/alerts.yaml); every type starts at 0, so a rate has a series from the start
        self.problems: dict[str, int] = dict.fromkeys(PROBLEMS, 0)
        self.runs_counted_at = float("-inf")  # time.monotonic() of the last count (app.metrics)
        self.restarts = Counter("idemproxy_restarts_total", "Runs restarted by the supervisor",
                                registry=r)

    def observe(self, outcome: Outcome, total_s: float, upstream_s: float | None) -> None:
        self._outcomes[outcome] = self._outcomes.get(outcome, 0) + 1
        if upstream_s is not None:
            self._upstream.observe(upstream_s)
            self._overhead.observe(max(0.0, total_s - upstream_s))
        elif outcome in OWN_TIME_ONLY:
            self._overhead.observe(total_s)

    def saved(self, upstream: UpstreamSettings, kid: str, recorded: Recorded) -> None:
        """Count the tokens, and what they cost (pricing.py), that a replay did not pay again.

        A key's first replays here are counted after they have been answered, once such
        replays pause (``_price_soon``), or when the metrics are read: a restarted attempt
        replays hundreds of keys for the first time, one after the other, each while the
        agent waits, and working out one key's savings (its answer parsed for its usage,
        genai-prices' lookup: 0.2-0.5 ms) would take the CPU from the burst."""
        savings = self._savings.get(kid)
        if savings is not None:
            self._count(upstream, *savings, 1)
            return
        waiting = self._unpriced.get(kid)
        if waiting is not None:
            waiting[2] += 1
            return
        self._unpriced[kid] = [upstream, recorded, 1]
        if len(recorded.body) > HELD_BODY_BYTES:  # not held until the burst pauses: at once
            self._price(kid)
        else:
            self._price_soon()

    def settle(self) -> None:
        """Count every replay whose key's savings have not been worked out yet (see ``saved``)."""
        while self._unpriced:
            self._price(next(iter(self._unpriced)))

    def _price_soon(self) -> None:
        """Work out the waiting keys PRICE_WHEN_QUIET_S after the last new one, unless too many wait."""
        self._new_key_at = time.monotonic()
        backlog = len(self._unpriced) >= PRICE_BACKLOG
        if self._pricing is not None and not backlog:
            return  # the tick already due looks at the time itself: one timer per burst, not one per key
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a command, a test): at once
            self.settle()
            return
        if self._pricing is not None:
            self._pricing.cancel()
        self._pricing = loop.call_soon(self._tick) if backlog else loop.call_later(PRICE_WHEN_QUIET_S, self._tick)

    def _tick(self) -> None:
        """One key once replays of new keys have paused; then the next on the loop's next turn."""
        self._pricing = None
        if not self._unpriced:
            return
        loop = asyncio.get_running_loop()
        wait = self._new_key_at + PRICE_WHEN_QUIET_S - time.monotonic()
        if wait > 0 and len(self._unpriced) < PRICE_BACKLOG:  # a new key came meanwhile
            self._pricing = loop.call_later(wait, self._tick)
            return
        self._price(next(iter(self._unpriced)))
        if self._unpriced:
            self._pricing = loop.call_soon(self._tick)

    def _price(self, kid: str) -> None:
        upstream, recorded, replays = self._unpriced.pop(kid)
        tokens = usage(recorded)
        named = model_of(recorded) if tokens else None
        savings = named or "unknown", tokens, cost_usd(upstream, named, tokens) if tokens else 0.0
        if len(self._savings) >= SAVINGS_CACHE:
            self._savings.clear()
        self._savings[kid] = savings
        self._count(upstream, *savings, replays)

    def _count(self, upstream: UpstreamSettings, model: str, tokens: dict[str, int], cost: float,
               replays: int) -> None:
        for kind, n in tokens.items():
            counted = (upstream.name, model, kind)
            self._tokens_saved[counted] = self._tokens_saved.get(counted, 0) + n * replays
        if cost:
            self._cost_saved[upstream.name, model] = self._cost_saved.get((upstream.name, model), 0.0) + cost * replays

    def problem(self, slug: str) -> None:
        """One problem+json answer of type ``slug`` (errors.problem_middleware)."""
        self.problems[slug] = self.problems.get(slug, 0) + 1

    def set_runs(self, counts: dict[str, int]) -> None:
        """The runs gauge from the store's count by state (a state with no run shows 0)."""
        for state in RUN_STATES:
            self.runs.labels(state).set(counts.get(state, 0))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def spend(upstream: UpstreamSettings, recorded: Recorded) -> tuple[str, dict[str, int], float]:
    """The model of a recorded answer, its tokens, and their cost (pricing.py): what a replay
    saves; the console shows it per step."""
    tokens = usage(recorded)
    model = model_of(recorded) if tokens else None
    return model or "unknown", tokens, cost_usd(upstream, model, tokens)


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


class Buckets:
    """A histogram's counts: one increment and one add per observation."""

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, value)] += 1
        self.sum += value

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        cumulative, total = [], 0
        for bound, count in zip((*map(str, BUCKETS), "+Inf"), self.counts):
            total += count
            cumulative.append((bound, total))
        return HistogramMetricFamily(name, doc, buckets=cumulative, sum_value=self.sum)


class _RequestCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self):
        m = self._metrics
        m.settle()
        requests = CounterMetricFamily("idemproxy_requests", "Requests by outcome", labels=["outcome"])
        for outcome, n in sorted(m._outcomes.items()):
            requests.add_metric([outcome], n)
        yield requests
        yield m._upstream.family("idemproxy_upstream_seconds", "Upstream time to headers")
        yield m._overhead.family("idemproxy_overhead_seconds", "The proxy's own time per request")
        tokens = CounterMetricFamily("idemproxy_tokens_saved", "Tokens not paid again thanks to "
                                     "replays, from the providers' usage fields", labels=["upstream", "model", "kind"])
        for labels, n in sorted(m._tokens_saved.items()):
            tokens.add_metric(list(labels), n)
        yield tokens
        cost = CounterMetricFamily("idemproxy_cost_saved_usd", "Cost not paid again thanks to replays, "
                                   "from usage fields and the model's price (genai-prices, or the upstream's prices)",
                                   labels=["upstream", "model"])
        for labels, usd in sorted(m._cost_saved.items()):
            cost.add_metric(list(labels), usd)
        yield cost
        problems = CounterMetricFamily("idemproxy_problems", "Refusals and failures answered as "
                                       "problem+json, by type (proxy/problems.py)", labels=["type"])
        for slug, n in sorted(m.problems.items()):
            problems.add_metric([slug], n)
        yield problems
        yield CounterMetricFamily("idemproxy_replays_from_memory", "Replays answered from a restarted "
                                  "attempt's journal, loaded in one read", value=m.replayed_from_memory)
        yield CounterMetricFamily("idemproxy_replays_from_answer_cache", "Replays answered from complete "
                                  "entries held in the process's memory", value=m.replayed_from_cache)
