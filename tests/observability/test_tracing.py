"""OpenTelemetry spans per proxied call, exported over OTLP/HTTP to a real
receiver in the test, which decodes the protobuf the SDK's exporter posts."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from idemproxy.proxy.observability import tracing
from idemproxy.proxy.config import ConfigError

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
AGENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
AGENT_PARENT = f"00-{AGENT_TRACE}-b7ad6b7169203331-01"


@pytest.fixture
async def receiver():
    """An OTLP/HTTP trace receiver: POST /v1/traces, protobuf in; the spans it got, out."""
    spans: list = []

    async def traces(request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        message = ExportTraceServiceRequest.FromString(await request.read())
        for resource in message.resource_spans:
            service = {a.key: a.value.string_value for a in resource.resource.attributes}["service.name"]
            for scope in resource.scope_spans:
                spans.extend((service, span) for span in scope.spans)
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("")).rstrip("/"), spans
    await server.close()


def attributes(span) -> dict:
    out = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        out[a.key] = getattr(a.value, kind)
    return out


async def test_each_proxied_call_is_a_span_with_genai_and_idemproxy_attributes(
        receiver, monkeypatch, make_proxy, tmp_path, http, provider):
    endpoint, spans = receiver
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    proxy = await make_proxy(f"sqlite:///{tmp_path / 'j.db'}")
    url = f"{proxy.url}/openai/v1/chat/completions"
    async with http.post(url, json=CHAT, headers={"Idem-Run": "traced", "Idem-Epoch": "0",
                                                  "traceparent": AGENT_PARENT}) as resp:
        assert resp.status == 200
    async with http.post(url, json=CHAT, headers={"Idem-Run": "traced", "Idem-Epoch": "1"}) as resp:
        assert resp.status == 200 and resp.headers["Idempotent-Replayed"] == "true"
    async with http.get(f"{proxy.url}/healthz") as resp:  # not a proxied call: no span
        assert resp.status == 200
    for _ in range(100):
        if len(spans) >= 2:
            break
        await asyncio.sleep(0.05)
    assert len(spans) == 2, spans
    (service, recorded), (_, replayed) = sorted(spans, key=lambda s: s[1].start_time_unix_nano)
    assert service == "idemproxy"
    assert recorded.name == "POST openai"

    # the agent's trace goes on through the proxy to the upstream
    assert recorded.trace_id.hex() == AGENT_TRACE and recorded.parent_span_id.hex() == "b7ad6b7169203331"
    seen = provider.seen[-1]["headers"]
    assert seen["traceparent"] == f"00-{AGENT_TRACE}-{recorded.span_id.hex()}-01"

    first, again = attributes(recorded), attributes(replayed)
    assert first["idemproxy.outcome"] == "recorded" and again["idemproxy.outcome"] == "replayed"
    for attrs, epoch in ((first, 0), (again, 1)):
        assert attrs["gen_ai.provider.name"] == "openai"
        assert attrs["gen_ai.request.model"] == "gpt-4o-mini"
        assert (attrs["gen_ai.usage.input_tokens"], attrs["gen_ai.usage.output_tokens"]) == (10, 5)
        assert attrs["idemproxy.run"] == "traced" and attrs["idemproxy.epoch"] == epoch
        assert attrs["idemproxy.key_kind"] == "derived" and len(attrs["idemproxy.kid"]) == 64
        assert attrs["idemproxy.store_ms"] > 0
        assert attrs["http.response.status_code"] == 200
    assert first["idemproxy.kid"] == again["idemproxy.kid"]
    assert provider.calls["chat"] == 1  # the replay did not reach the upstream


def test_tracing_is_off_unless_the_environment_asks():
    assert not tracing.wanted({})
    assert not tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"})
    assert not tracing.wanted({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})
    assert tracing.wanted({"OTEL_TRACES_EXPORTER": "otlp"})
    with pytest.raises(ConfigError, match="OTLP only"):
        tracing.wanted({"OTEL_TRACES_EXPORTER": "zipkin"})


@pytest.mark.slow
def test_a_proxy_without_tracing_never_imports_opentelemetry():
    # this module imports opentelemetry-proto; ask a fresh interpreter instead
    code = ("import sys; from idemproxy.proxy.cli.serving import build_app; from idemproxy.proxy.config import "
            "load_settings; build_app(load_settings(env={}), supervise=False); "
            "print(any(m.startswith('opentelemetry') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "False"
