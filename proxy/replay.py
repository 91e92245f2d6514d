"""Answers from the journal: replays of records, and listeners of calls in flight."""

from __future__ import annotations

import asyncio
import time

import orjson
from aiohttp import web

from .calls import Call
from .exchange import EXCHANGE, Readdress
from .problems import Problem
from .store import Store
from .store.model import Entry, EntryState, Recorded
from .upstream.wire import Answer, StreamedAnswer

REPLAYED = "Idempotent-Replayed"


class ReaddressedStream(StreamedAnswer):
    """A streamed replay or join whose bytes are rewritten on their way to the caller."""

    def __init__(self, readdress: Readdress, **kwargs) -> None:
        super().__init__(**kwargs)
        self._readdress = readdress

    async def write(self, data) -> None:
        out = self._readdress.chunk(bytes(data))
        if out:
            await super().write(out)

    async def write_eof(self, data: bytes = b"") -> None:
        rest = self._readdress.chunk(data) + self._readdress.end() if data else self._readdress.end()
        await super().write_eof(rest)


async def start_stream(request: web.Request, status: int, headers,
                       replayed: bool = False) -> web.StreamResponse:
    """Send the head of a streamed answer; from here on, a failure can only cut it short."""
    exchange = request[EXCHANGE]
    readdress = exchange.readdress if replayed else None
    if readdress is None:
        resp = StreamedAnswer(status=status, headers=headers)
    else:
        resp = ReaddressedStream(readdress, status=status, headers=headers)
    await resp.prepare(request)
    exchange.stream = resp
    return resp


def replayed_body(request: web.Request, body: bytes) -> bytes:
    """A whole recorded answer, addressed to this caller."""
    readdress = request[EXCHANGE].readdress
    return body if readdress is None else readdress.body(body)


def cut_short(request: web.Request) -> web.StreamResponse:
    """End a streamed answer without its terminating chunk, so no client takes it for whole."""
    if request.transport is not None:
        request.transport.close()
    return request[EXCHANGE].stream


def server_timing(own_s: float, upstream_s: float | None = None) -> str:
    value = f"idemproxy;dur={own_s * 1000:.2f}"
    if upstream_s is not None:
        value += f", upstream;dur={upstream_s * 1000:.2f}"
    return value


def _headers(headers, replayed: bool, timing: str) -> list[tuple[str, str]]:
    return [*headers, (REPLAYED, "true" if replayed else "false"), ("Server-Timing", timing)]


def whole_record(request: web.Request, recorded: Recorded) -> web.Response:
    """A replay of an answer that was not streamed: no coroutine needed (docs/performance.md)."""
    headers = _headers(recorded.headers, True, server_timing(time.perf_counter() - request[EXCHANGE].started))
    return Answer(status=recorded.status, body=replayed_body(request, recorded.body), headers=headers)


async def send_record(request: web.Request, recorded: Recorded, paced: bool = False) -> web.StreamResponse:
    """A replay: the recorded status, headers and body; a stream is replayed as a stream."""
    if not recorded.streamed:
        return whole_record(request, recorded)
    headers = _headers(recorded.headers, True, server_timing(time.perf_counter() - request[EXCHANGE].started))
    resp = await start_stream(request, recorded.status, headers, replayed=True)
    if paced and recorded.timing:
        clock = time.perf_counter()
        bounds = [offset for offset, _ in recorded.timing[1:]] + [len(recorded.body)]
        for (offset, at), end in zip(recorded.timing, bounds):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - clock)))
            await resp.write(recorded.body[offset:end])
    else:
        await resp.write(recorded.body)
    await resp.write_eof()
    return resp


async def listen(request: web.Request, call: Call, replayed: bool) -> web.StreamResponse:
    """Answer from a call in flight in this process: bytes so far, then the rest live.
    While anyone listens, the call reads on even when it can record nothing (calls.py)."""
    call.listeners += 1
    try:
        return await _listen(request, call, replayed)
    finally:
        call.listeners -= 1


async def _listen(request: web.Request, call: Call, replayed: bool) -> web.StreamResponse:
    listening = time.perf_counter()
    await call.headers_ready()
    if not call.status:  # failed before the upstream answered
        result = await call.finished()
        raise Problem(*result.problem)
    # the proxy's own time up to the head, as this listener met it (the body's time is the upstream's)
    at_head = max(call.head_at, listening)
    timing = server_timing(at_head - request[EXCHANGE].started - call.upstream_s, call.upstream_s)
    headers = _headers(call.headers, replayed, timing)
    if not call.streamed:
        result = await call.finished()
        if result.problem:
            raise Problem(*result.problem)
        body = b"".join(call.chunks)
        return Answer(status=call.status, body=replayed_body(request, body) if replayed else body,
                      headers=headers)
    resp = await start_stream(request, call.status, headers, replayed)
    index, done = 0, False
    while not done:
        try:
            chunks, done = await call.chunks_from(index)
        except LookupError:  # too far behind on a stream too large to keep
            return cut_short(request)
        index += len(chunks)
        for chunk in chunks:
            await resp.write(chunk)
    if call.result.problem:  # the stream broke: the agent must not take it for complete
        return cut_short(request)
    await resp.write_eof()
    return resp


async def join_remote(request: web.Request, store: Store, claim: Entry, deadline: float) -> web.StreamResponse | None:
    """Join a stream that another proxy is recording under ``claim``, through its partials in
    the store.

    Bytes in the store are not an answer: a proxy killed mid-stream leaves them there until
    its lease ends, and a replay is the whole recorded answer or nothing (docs/guarantees.md). So the
    head is sent only once the recording proxy shows it is alive, by sharing bytes (or the
    empty piece a quiet stream shares, sharing.ALIVE_S) after this request first looked, or
    by completing the record; until then the request waits as for any key in flight, until
    ``deadline`` (then 409 in-flight). None: ``claim`` is no longer in flight (it ended,
    its lease ran out, or its stream has not begun): the caller looks at the key afresh,
    and an expired claim is then ambiguous (docs/concepts.md).

    Once bytes are sent, the answer follows that one claim to its recorded end, or is cut
    short: its proxy died, the stream broke, or another claim took the key over (whose bytes
    would not continue these).
    """
    journal = store.journal
    shared = await journal.read_partial(claim.kid, -1)
    if not shared or shared[0][0] != 0:
        return None
    seq = shared[-1][0]  # maybe all a dead proxy left behind
    while True:
        fresh = await journal.read_partial(claim.kid, seq)
        entry = await journal.get(claim.kid)  # after the read: were those bytes this claim's?
        if not _same_claim(entry, claim):
            return None
        if entry.state == EntryState.COMPLETE and entry.response is not None:
            return await send_record(request, entry.response)
        if entry.state != EntryState.IN_FLIGHT or entry.lease_until < time.time():
            return None
        if fresh:  # alive
            break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise in_flight()
        await journal.wait(claim.kid, min(remaining, 1.0))
    meta = orjson.loads(shared[0][1])
    resp = await start_stream(request, meta["status"], _headers(
        meta["headers"], True, server_timing(time.perf_counter() - request[EXCHANGE].started)), replayed=True)
    sent, pending = 0, shared[1:] + fresh
    while True:
        for s, data in pending:
            if data:  # an empty piece: its proxy lives (sharing.ALIVE_S)
                await resp.write(data)
            seq, sent = s, sent + len(data)
        await journal.wait(claim.kid, 1.0)
        pending = await journal.read_partial(claim.kid, seq)
        entry = await journal.get(claim.kid)
        if not _same_claim(entry, claim):
            return cut_short(request)  # taken over: the new call's bytes do not continue these
        if entry.state == EntryState.COMPLETE and entry.response is not None:
            await resp.write(entry.response.body[sent:])
            await resp.write_eof()
            return resp
        if entry.state != EntryState.IN_FLIGHT or entry.lease_until < time.time():
            return cut_short(request)  # the stream broke upstream, or its proxy died


def _same_claim(entry: Entry | None, claim: Entry) -> bool:
    """Whether ``entry`` is still the outcome of ``claim``: a new claim on the key (a
    takeover of an expired one) has a new ``created_at``."""
    return entry is not None and entry.created_at == claim.created_at


def key_reused(how: str) -> Problem:
    return Problem("key-reused", f"this Idempotency-Key {how} with a different request "
                   "(method, path or body)")


def outcome_unknown(entry: Entry) -> Problem:
    """502 for a quarantined key: it names the entry, and how an operator settles it."""
    kid = entry.kid
    command = f"idemproxy journal resolve {kid} --retry"
    endpoint = f"POST /admin/journal/{kid}/resolve"
    return Problem("outcome-unknown", f"the first call's outcome is unknown ({entry.detail or 'ambiguous'}); "
                   f"an operator must resolve journal entry {kid}: `{command}` (or --status N --body ...), "
                   f"{endpoint}, or the console's quarantine page", kid=kid,
                   resolve={"command": command, "endpoint": endpoint, "console": f"/ui/journal/{kid}"})


def in_flight() -> Problem:
    return Problem("in-flight", "the first request with this key has not finished",
                   headers={"Retry-After": "1"})
