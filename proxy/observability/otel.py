"""OpenTelemetry spans for proxied calls, exported over OTLP/HTTP (imported only when
tracing.py finds tracing asked for).

One span per proxied call, a child of the agent's ``traceparent`` when it sent one, with
the GenAI semantic conventions' attributes (provider, request model, tokens) and
idemproxy's own (run, epoch, key kind, outcome, store time). The upstream gets this
span's ``traceparent`` (W3C Trace Context), so its own spans hang under the proxy's.
The exporter, its endpoint, headers and batching come from the standard ``OTEL_*``
variables, read by the OpenTelemetry SDK itself.
"""

from __future__ import annotations

import os
from typing import Callable
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ..config import Settings, upstream_kind
from ..exchange import EXCHANGE

# gen_ai.provider.name's well-known values (semantic conventions 1.37+), by API host
PROVIDERS = {"api.openai.com": "openai", "api.anthropic.com": "anthropic",
             "generativelanguage.googleapis.com": "gcp.gemini", "api.mistral.ai": "mistral_ai",
             "api.groq.com": "groq", "api.deepseek.com": "deepseek", "api.x.ai": "x_ai"}


class Tracing:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # service.name is ours unless OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES name one
        named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get(
            "OTEL_RESOURCE_ATTRIBUTES", "")
        resource = Resource.create({} if named else {"service.name": "idemproxy"})
        # Our own provider, not the global one: an embedding application's tracing is its own.
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        self.tracer = self.provider.get_tracer("idemproxy")
        self.propagator = TraceContextTextMapPropagator()

    def middleware(self, traced: Callable[[web.Request], bool]) -> Middleware:
        """A span around each request ``traced`` picks (the proxied ones); outermost, so the
        outcome it reads is final (errors.problem_middleware sets it for refusals)."""

        @web.middleware
        async def span(request: web.Request, handler: Handler) -> web.StreamResponse:
            if not traced(request):
                return await handler(request)
            parent = self.propagator.extract(request.headers)
            with self.tracer.start_as_current_span(request.method, context=parent, kind=SpanKind.SERVER,
                                                   record_exception=False) as current:
                response = None
                try:
                    response = await handler(request)
                    return response
                finally:
                    self._describe(current, request, response)
        return span

    def _describe(self, span: trace.Span, request: web.Request, response: web.StreamResponse | None) -> None:
        """The span's name and attributes, once the call's outcome is known."""
        status = response.status if response is not None else 500
        span.set_attribute("http.request.method", request.method)
        span.set_attribute("http.response.status_code", status)
        exchange = request.get(EXCHANGE)
        span.set_attribute("idemproxy.outcome", str(exchange.outcome if exchange is not None else "rejected"))
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        facts = exchange.facts if exchange is not None else None
        if facts is None:  # refused before the proxy knew the upstream
            return
        span.update_name(f"{request.method} {facts.upstream}")
        attrs = {"idemproxy.upstream": facts.upstream, "idemproxy.run": facts.run,
                 "idemproxy.epoch": facts.epoch, "idemproxy.kid": facts.kid,
                 "idemproxy.key_kind": facts.key_kind, "idemproxy.store_ms": round(facts.store_s * 1000, 3)}
        upstream = self.settings.upstreams.get(facts.upstream)
        if upstream is not None and upstream_kind(upstream) == "model":
            host = urlsplit(upstream.url).hostname or ""
            attrs.update({"gen_ai.provider.name": PROVIDERS.get(host, facts.upstream),
                          "gen_ai.request.model": facts.model,
                          "gen_ai.usage.input_tokens": facts.input_tokens,
                          "gen_ai.usage.output_tokens": facts.output_tokens})
        span.set_attributes({k: v for k, v in attrs.items() if v is not None})

    def inject(self, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """An upstream request's headers with the current span's ``traceparent`` in place of the
        agent's own: the call runs in a task that copies the request's context, so the span is
        current there too."""
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier)
        if not carrier:
            return headers
        # the agent's tracestate belongs to its traceparent: neither goes on beside ours
        ours = {name.lower() for name in carrier} | {"traceparent", "tracestate"}
        return [(k, v) for k, v in headers if k.lower() not in ours] + list(carrier.items())

    def shutdown(self) -> None:
        """Export what is still batched, then stop (blocking: run it in a thread)."""
        self.provider.shutdown()
