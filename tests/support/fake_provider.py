"""A fake LLM and tool provider that counts every call it gets.

Speaks enough of the OpenAI (``/v1/chat/completions``, ``/v1/responses``-free) and
Anthropic (``/v1/messages``) APIs for their official SDKs, plus tool endpoints with a
side effect (``/tools/...``). Behaviour is steered per request by headers, so a test
can ask for a status, a delay, a broken stream:

- ``X-Fake-Status: 503``       answer with that status
- ``X-Fake-Delay: 0.5``        wait before answering (seconds)
- ``X-Fake-Chunk-Delay: 0.1``  wait between stream chunks
- ``X-Fake-Chunks: 20``        number of content chunks in a stream
- ``X-Fake-Break: 3``          close the connection after that many chunks
- ``X-Fake-Size: 1000000``     body of that many bytes (``/blob``, ``/flood``)
- ``X-Fake-Split: 0.3``        send each event in two writes, that many seconds apart

Scripted tool calls, for agent frameworks (tests/clients/test_frameworks.py): a request that offers
``tools`` and whose prompt holds a line ``PLAN: [{"tool": "send_email", "args": {...}}, ...]``
is answered with the plan's next tool call, the k-th when k tool results are already in the
conversation, and with a final text once all were answered. Chat Completions
(``role: tool`` messages) and Responses (``function_call_output`` items, ``/v1/responses``)
alike; the answer depends on the request alone, so a replayed conversation goes on the same.
``/v1/traces/ingest`` takes the OpenAI Agents SDK's traces.

Run alone: ``python tests/support/fake_provider.py --port 9100``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools

import orjson
from aiohttp import web

CALLS = web.AppKey("calls", collections.Counter)
SEEN = web.AppKey("seen", list)
OPEN = web.AppKey("open", collections.Counter)  # answers still being sent, by route
_ids = itertools.count(1)


def _delay(request: web.Request, name: str = "X-Fake-Delay") -> float:
    return float(request.headers.get(name, "0"))


async def _maybe_status(request: web.Request) -> web.Response | None:
    status = int(request.headers.get("X-Fake-Status", "200"))
    if status != 200:
        return web.json_response({"error": {"message": f"fake {status}", "type": "fake"}}, status=status)
    return None


def _record(request: web.Request, name: str, body: bytes) -> None:
    request.app[CALLS][name] += 1
    request.app[SEEN].append({"name": name, "method": request.method, "path": request.path_qs,
                              "headers": dict(request.headers), "body": body})


async def _stream(request: web.Request, events: list[bytes]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    brk = int(request.headers.get("X-Fake-Break", "-1"))
    gap = _delay(request, "X-Fake-Chunk-Delay")
    split = _delay(request, "X-Fake-Split")
    for i, event in enumerate(events):
        if i == brk:
            request.transport.close()  # a broken upstream stream
            return resp
        if split:  # an event cut across two network reads, as TCP may deliver it
            await resp.write(event[:len(event) // 2])
            await asyncio.sleep(split)
            event = event[len(event) // 2:]
        await resp.write(event)
        if gap:
            await asyncio.sleep(gap)
    await resp.write_eof()
    return resp


PLAN_MARK = "PLAN:"


def _texts(content) -> list[str]:
    """The text of a message's content: a string, or a list of parts with ``text``."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [part.get("text", "") for part in content if isinstance(part, dict)]
    return []


def _plan(texts: list[str]) -> list[dict] | None:
    for text in texts:
        for line in text.splitlines():
            if line.strip().startswith(PLAN_MARK):
                return orjson.loads(line.strip()[len(PLAN_MARK):])
    return None


def _scripted(req: dict, texts: list[str], answered: int) -> tuple[dict, str] | tuple[None, str]:
    """The plan's next tool call (``{"name", "arguments", "call_id"}``) or the final text."""
    plan = _plan(texts) if req.get("tools") else None
    if plan is None:
        return None, ""
    if answered < len(plan):
        step = plan[answered]
        return {"name": step["tool"], "arguments": orjson.dumps(step.get("args", {})).decode(),
                "call_id": f"call_{answered + 1}_{step['tool']}"}, ""
    return None, f"done: {answered} tool calls answered"


def _scripted_chunks(n: int, model: str | None, call: dict | None, final: str) -> list[bytes]:
    """A scripted answer as Chat Completions stream events: the tool call's name, then its
    arguments, or the final text; then the finish reason with usage, then [DONE]."""
    def chunk(delta: dict, finish: str | None = None, **extra) -> bytes:
        return b"data: " + orjson.dumps({
            "id": f"chatcmpl-{n}", "object": "chat.completion.chunk", "created": 1, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}) + b"\n\n"
    if call is not None:
        events = [chunk({"role": "assistant", "content": None, "tool_calls": [{
                      "index": 0, "id": call["call_id"], "type": "function",
                      "function": {"name": call["name"], "arguments": ""}}]}),
                  chunk({"tool_calls": [{"index": 0, "function": {"arguments": call["arguments"]}}]})]
    else:
        events = [chunk({"role": "assistant", "content": final})]
    events.append(chunk({}, "tool_calls" if call is not None else "stop",
                        usage={"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}))
    return [*events, b"data: [DONE]\n\n"]


async def chat(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    _record(request, "chat", body)
    await asyncio.sleep(_delay(request))
    if (failed := await _maybe_status(request)) is not None:
        return failed
    req = orjson.loads(body or b"{}")
    n = next(_ids)
    messages = req.get("messages") or []
    call, final = _scripted(req, [t for m in messages if m.get("role") in ("system", "developer", "user")
                                  for t in _texts(m.get("content"))],
                            sum(m.get("role") == "tool" for m in messages))
    if (call is not None or final) and req.get("stream"):
        return await _stream(request, _scripted_chunks(n, req.get("model"), call, final))
    if call is not None or final:
        message = {"role": "assistant", "content": final or None}
        if call is not None:
            message["tool_calls"] = [{"id": call["call_id"], "type": "function", "function": {
                "name": call["name"], "arguments": call["arguments"]}}]
        return web.json_response({
            "id": f"chatcmpl-{n}", "object": "chat.completion", "created": 1, "model": req.get("model", "fake"),
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if call else "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}})
    last = (req.get("messages") or [{}])[-1].get("content", "")
    text = f"reply {n} to: {str(last)[:40]}"
    if req.get("stream"):
        chunks = int(request.headers.get("X-Fake-Chunks", "5"))
        events = [b"data: " + orjson.dumps({
            "id": f"chatcmpl-{n}", "object": "chat.completion.chunk", "created": 1, "model": req.get("model"),
            "choices": [{"index": 0, "delta": {"content": f"{text}[{i}]"}, "finish_reason": None}]}) + b"\n\n"
            for i in range(chunks)]
        events.append(b"data: " + orjson.dumps({
            "id": f"chatcmpl-{n}", "object": "chat.completion.chunk", "created": 1, "model": req.get("model"),
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": chunks, "total_tokens": 10 + chunks}}) + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        return await _stream(request, events)
    return web.json_response({
        "id": f"chatcmpl-{n}", "object": "chat.completion", "created": 1, "model": req.get("model", "fake"),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}},
        headers={"Set-Cookie": "session=secret-cookie", "X-Request-Id": f"req-{n}"})


async def responses(request: web.Request) -> web.Response:
    """The Responses API (non-streaming): scripted tool calls, or a text reply."""
    body = await request.read()
    _record(request, "responses", body)
    await asyncio.sleep(_delay(request))
    if (failed := await _maybe_status(request)) is not None:
        return failed
    req = orjson.loads(body or b"{}")
    n = next(_ids)
    items = req.get("input")
    items = [{"role": "user", "content": items}] if isinstance(items, str) else items or []
    texts = [req.get("instructions") or ""] + [t for item in items if item.get("role") in ("system", "developer", "user")
                                               for t in _texts(item.get("content"))]
    call, final = _scripted(req, texts, sum(item.get("type") == "function_call_output" for item in items))
    if call is not None:
        output = [{"type": "function_call", "id": f"fc_{n}", "status": "completed", **call}]
    else:
        text = final or f"reply {n} to: {texts[-1][:40]}"
        output = [{"type": "message", "id": f"msg_{n}", "status": "completed", "role": "assistant",
                   "content": [{"type": "output_text", "text": text, "annotations": []}]}]
    return web.json_response({
        "id": f"resp_{n}", "object": "response", "created_at": 1, "status": "completed",
        "model": req.get("model", "fake"), "output": output, "parallel_tool_calls": True,
        "tool_choice": "auto", "tools": req.get("tools", []), "error": None, "incomplete_details": None,
        "instructions": req.get("instructions"), "metadata": {}, "temperature": None, "top_p": None,
        "usage": {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15,
                  "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}})


async def traces(request: web.Request) -> web.Response:
    _record(request, "traces", await request.read())
    return web.json_response({})


async def messages(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    _record(request, "messages", body)
    await asyncio.sleep(_delay(request))
    if (failed := await _maybe_status(request)) is not None:
        return failed
    req = orjson.loads(body or b"{}")
    n = next(_ids)
    text = f"claude reply {n}"
    message = {"id": f"msg_{n}", "type": "message", "role": "assistant", "model": req.get("model", "fake"),
               "content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
               "stop_sequence": None, "usage": {"input_tokens": 12, "output_tokens": 6}}
    if not req.get("stream"):
        return web.json_response(message)

    def ev(kind: str, data: dict) -> bytes:
        return f"event: {kind}\n".encode() + b"data: " + orjson.dumps({"type": kind, **data}) + b"\n\n"
    start = {**message, "content": [], "stop_reason": None, "usage": {"input_tokens": 12, "output_tokens": 1}}
    events = [ev("message_start", {"message": start}),
              ev("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})]
    events += [ev("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": w + " "}})
               for w in text.split()]
    events += [ev("content_block_stop", {"index": 0}),
               ev("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                    "usage": {"output_tokens": 6}}),
               ev("message_stop", {})]
    return await _stream(request, events)


async def tool(request: web.Request) -> web.Response:
    """A tool with a side effect: every call that reaches it 'sends' something."""
    body = await request.read()
    name = "tool:" + request.match_info["name"]
    _record(request, name, body)
    await asyncio.sleep(_delay(request))
    if (failed := await _maybe_status(request)) is not None:
        return failed
    return web.json_response({"ok": True, "tool": request.match_info["name"], "n": next(_ids),
                              "echo": orjson.loads(body) if body else None})


async def blob(request: web.Request) -> web.Response:
    _record(request, "blob", await request.read())
    return web.Response(body=b"x" * int(request.headers.get("X-Fake-Size", "1024")),
                        content_type="application/octet-stream")


async def flood(request: web.Request) -> web.StreamResponse:
    """Generated bytes, never held whole: ``X-Fake-Size`` of them with a Content-Length, or
    an endless chunked stream without it (paced by ``X-Fake-Chunk-Delay``). Stops when the
    reader goes away; ``OPEN["flood"]`` counts those still flowing."""
    _record(request, "flood", await request.read())
    size = int(request.headers.get("X-Fake-Size", "-1"))
    gap = _delay(request, "X-Fake-Chunk-Delay")
    resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    if size >= 0:
        resp.content_length = size
    await resp.prepare(request)
    block, sent = b"x" * 65536, 0
    request.app[OPEN]["flood"] += 1
    try:
        while size < 0 or sent < size:
            if sent:
                await asyncio.sleep(gap)
            n = len(block) if size < 0 else min(len(block), size - sent)
            await resp.write(block[:n])
            sent += n
        await resp.write_eof()
    except ConnectionError:
        pass  # the reader left
    finally:
        request.app[OPEN]["flood"] -= 1
    return resp


async def echo(request: web.Request) -> web.Response:
    """Shows what reached the upstream: path, query and headers."""
    body = await request.read()
    _record(request, "echo", body)
    return web.json_response({"method": request.method, "path": request.path, "raw_path": request.raw_path,
                              "query": request.query_string, "headers": dict(request.headers),
                              "body": body.decode(errors="replace")})


async def calls(request: web.Request) -> web.Response:
    return web.json_response(dict(request.app[CALLS]))


async def small(request: web.Request) -> web.Response:
    """The benchmark's upstream: a small JSON answer, like a short model reply."""
    await request.read()
    request.app[CALLS]["small"] += 1
    return web.Response(body=b'{"ok":true,"usage":{"prompt_tokens":3,"completion_tokens":2}}',
                        content_type="application/json")


def create_app() -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[CALLS] = collections.Counter()
    app[SEEN] = []
    app[OPEN] = collections.Counter()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/traces/ingest", traces)
    app.router.add_route("*", "/tools/{name}", tool)
    app.router.add_route("*", "/blob", blob)
    app.router.add_route("*", "/flood", flood)
    app.router.add_route("*", "/echo/{tail:.*}", echo)
    app.router.add_route("*", "/small", small)
    app.router.add_get("/_calls", calls)
    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9100)
    args = parser.parse_args()
    web.run_app(create_app(), host=args.host, port=args.port, access_log=None, print=None)
