"""The fault campaign's upstream: a model and a tool that write down every call they get.

- ``POST /v1/chat/completions``: a model. Each delivery is a new completion with a number of
  its own (JSON, or a stream of server-sent events when asked), as a real model's answers
  differ from call to call.
- ``POST /tools/{name}``: a tool with a side effect. It honours ``Idempotency-Key`` as
  payment APIs do: the first delivery of a key executes (a new number), a repeat gets the
  first answer and executes nothing. The proxy forwards a key derived from its journal key
  (``idempotency_header``), so a call it sends again after an ambiguous outcome (the proxy
  that made it was killed mid-call) is caught here; a call sent under a *different* key for
  the same logical step is executed twice, and that is what the campaign counts as a
  duplicate.

Each delivery names its logical step (run and step, from the body), so the campaign can
count per step: deliveries, executions, and whether any came after an agent had already
seen an answer for the step.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

import orjson
from aiohttp import web

MODEL_DELAY_S = 0.03
TOOL_DELAY_S = 0.03
STREAM_CHUNKS = 5
CHUNK_DELAY_S = 0.02  # a stream takes ~0.1 s: proxies get killed in the middle of some


@dataclass(frozen=True, slots=True)
class Delivery:
    kind: str  # "chat" or "tool"
    run: str
    step: int
    key: str | None  # the Idempotency-Key the proxy forwarded
    executed: bool  # False: a repeat of a key, answered without a side effect
    t: float  # time.time() on arrival


@dataclass
class Ledger:
    deliveries: list[Delivery] = field(default_factory=list)
    _numbers: itertools.count = field(default_factory=lambda: itertools.count(1))
    _answers: dict[str, bytes] = field(default_factory=dict)  # the tool's answers, by key

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/tools/{name}", self.tool)
        return app

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        meta = body["metadata"]
        self.deliveries.append(Delivery("chat", meta["run"], int(meta["step"]), None, True, time.time()))
        n = next(self._numbers)
        await asyncio.sleep(MODEL_DELAY_S)
        text = f"answer {n} to {meta['run']} step {meta['step']}"
        if not body.get("stream"):
            return web.json_response({
                "id": f"chatcmpl-{n}", "object": "chat.completion", "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": "stop"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        words = text.split(" ")
        try:
            for i in range(STREAM_CHUNKS):
                piece = " ".join(words[i::STREAM_CHUNKS])  # every chunk says something; the order is ours
                piece = (" " if i else "") + piece
                await resp.write(b"data: " + orjson.dumps({
                    "id": f"chatcmpl-{n}", "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}) + b"\n\n")
                await asyncio.sleep(CHUNK_DELAY_S)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the proxy reading it was killed: the campaign's doing, not an error
        return resp

    async def tool(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        key = request.headers.get("Idempotency-Key")
        answer = self._answers.get(key) if key is not None else None
        self.deliveries.append(Delivery("tool", body["run"], int(body["step"]), key, answer is None, time.time()))
        if answer is None:  # the side effect, done at once: a later repeat of the key finds it
            answer = orjson.dumps({"ok": True, "tool": request.match_info["name"], "n": next(self._numbers),
                                   "run": body["run"], "step": body["step"]})
            if key is not None:
                self._answers[key] = answer
        await asyncio.sleep(TOOL_DELAY_S)
        return web.Response(body=answer, content_type="application/json")
