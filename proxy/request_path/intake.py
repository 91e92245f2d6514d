"""What a proxied request is, read once at its start: its route, who sends it and whether it
is recorded, its body (as received and decoded), the facts its log line and span will show,
and whose tenant it is (resolved when first needed, then kept on its Exchange)."""

from __future__ import annotations

from aiohttp import hdrs, web

from .. import policy
from ..codings import decoded
from ..config import UpstreamSettings
from ..exchange import Exchange
from ..fingerprint import fingerprint
from ..identity import Identity, TenantResolver, parse_epoch, parse_key, parse_policy, parse_run
from ..observability.facts import Facts
from ..policy import Policy
from ..problems import Problem
from ..routing import Route, origin_form, parse_route


def route_of(request: web.Request, upstreams: dict[str, UpstreamSettings]) -> Route:
    """The upstream, run and epoch the target names; a WebSocket upgrade is refused."""
    target = request.raw_path
    if not target.startswith("/"):  # absolute-form: taken when it names us (routing.py)
        target = origin_form(target, request.headers.getall(hdrs.HOST, ()))
    route = parse_route(target, upstreams)
    if "websocket" in request.headers.get(hdrs.UPGRADE, "").lower():
        # Frames on a WebSocket are no requests the journal could key, record or replay
        # (the OpenAI Agents SDK's opt-in Responses transport): refused, never tunnelled unjournaled.
        raise Problem("websocket-refused", "idemproxy journals HTTP requests and cannot journal a "
                      "WebSocket: use the client's HTTP transport (for the OpenAI Agents SDK, the "
                      "default, set_default_openai_responses_transport(\"http\"))")
    return route


def identify(tenants: TenantResolver, request: web.Request, route: Route,
             decide: bool = True) -> tuple[Identity, Policy | None]:
    """Who the request is and, with ``decide``, whether it is recorded. A passthrough
    outside a run uses no namespace, so it is not derived (TenantResolver.namespace)."""
    headers = request.headers
    run = route.run or parse_run(headers.get("Idem-Run"))
    epoch = route.epoch if route.epoch is not None else parse_epoch(headers.get("Idem-Epoch"))
    if epoch is not None and run is None:
        raise Problem("invalid-header", "Idem-Epoch needs a run (Idem-Run or /runs/{run_id}/...)")
    key = parse_key(headers.getall("Idempotency-Key", ()))
    override = parse_policy(headers.get("Idem-Policy"))
    chosen = None
    if decide:
        chosen = policy.decide(route.upstream, request.method, route.path, override=override,
                               has_key=key is not None, has_run=run is not None)
    derive = chosen is not Policy.PASSTHROUGH or run is not None
    return Identity(key=key, run=run, epoch=epoch, policy=override,
                    namespace=tenants.namespace(headers, request.remote, derive=derive, run=run,
                                                token=route.token)), chosen


def tenant_of(tenants: TenantResolver, request: web.Request, exchange: Exchange) -> str:
    """Whose entries and connections the request's are (TenantResolver.tenant): resolved once
    per request, when first asked, from its namespace."""
    tenant = exchange.tenant
    if tenant is None:
        tenant = exchange.tenant = tenants.tenant(request.headers, exchange.ident.namespace)
    return tenant


async def read_body(request: web.Request, limit: int) -> tuple[bytes, bytes]:
    """The body as received, which is forwarded, and its content decoded per its
    Content-Encoding, which the proxy reads (codings.py). Both are held to ``limit``
    (``max_request_bytes``)."""
    length = request.content_length  # parsed anew at every look: look once
    if length is not None and length > limit:
        raise Problem("too-large", f"request body over {limit} bytes", max_request_bytes=limit)
    if not request.body_exists:
        return b"", b""
    content = request.content
    if content.is_eof():  # all of it came with the head: taken as it lies, no read loop
        body = content.read_nowait()
    elif length is not None:  # bounded above: read it in one go
        body = await request.read()
    else:
        body = bytearray()
        async for chunk in content.iter_any():
            body += chunk
            if len(body) > limit:
                break
        body = bytes(body)
    if len(body) > limit:  # chunked: no length said so beforehand
        raise Problem("too-large", f"request body over {limit} bytes", max_request_bytes=limit)
    return body, decoded(body, request.headers, limit)


def note(exchange: Exchange, route: Route, ident: Identity, content: bytes) -> Facts:
    """Start the call's facts for its access-log line and trace span (observability/facts.py);
    the steps after add the key, store time and answer as they learn them."""
    facts = exchange.facts = Facts(route.upstream.name, ident.run, ident.epoch, body=content)
    return facts


def fingerprint_of(request: web.Request, route: Route, content: bytes) -> str:
    """What makes two calls the same (docs/concepts.md): read from the body's decoded content, so a
    body sent compressed is the same call as the same content sent plain."""
    upstream = route.upstream
    return fingerprint(request.method, upstream.name, route.path_qs, content,
                       request.headers.get("Content-Type", ""),
                       policy.ignored_fields(upstream, request.method, route.path),
                       policy.unordered_fields(upstream, request.method, route.path))
