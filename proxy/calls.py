"""One recorded upstream call in flight in this process, and everyone listening to it.

The call runs as its own task, apart from the request that started it: if the agent
goes away mid-stream, the call still reads the upstream to the end and records it
(those tokens are paid for). The request that started it, and any duplicate that
arrives meanwhile, are just listeners: they get the bytes so far, then the rest live.

Unless nothing can be recorded any more: once an answer is over ``max_record_bytes``, or
still coming ``max_record_seconds`` after the request was sent, it is unrecordable, and
when no listener is left the call stops reading and drops the upstream connection (an
endless stream nobody hears would otherwise hold a pooled connection forever).

The last bytes are published only after the record is durable, so no agent sees the
end of an answer that a crash could lose.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from .config import UpstreamSettings
from .evidence import evidence
from .forward import failure_slug, is_stream, never_sent, response_headers, storable_headers
from .policy import OnAmbiguous, Verdict, verdict
from .sharing import share
from .store import Store, StoreUnavailable
from .store.model import Recorded
from .upstream.connection import UpstreamResponse
from .upstream.pool import UpstreamPool

log = logging.getLogger("idemproxy.proxy")

# SSE events after which an SDK stops reading and the agent moves on (OpenAI chat,
# OpenAI Responses, Anthropic). The upstream may pause before it ends the body, so
# waiting for EOF alone would let the agent act on an answer not yet durable (rule 1).
# A line start cannot occur inside a JSON string, so model output cannot fake one.
TERMINAL_EVENT = re.compile(rb"(?m)^(?:data: \[DONE\]|event: message_stop|event: response\.completed)\r?$")


class Fate(StrEnum):
    """How a recorded call ended."""
    RECORDED = "recorded"          # the answer is in the journal
    RELEASED = "released"          # nothing happened upstream: the key is free again
    AMBIGUOUS = "ambiguous"        # the upstream may have acted; on_ambiguous=retry freed the key
    QUARANTINED = "quarantined"    # ... on_ambiguous=quarantine kept it as outcome-unknown
    UNRECORDABLE = "unrecordable"  # answered, but over max_record_bytes/seconds: replays get 409
    UNSAVED = "unsaved"            # answered, but the journal could not take it: withheld (rule 1)
    FAILED = "failed"              # the proxy failed (or shut down) before an outcome


# A duplicate that waited on a call ending like this goes upstream itself, as a retry would.
GIVEN_BACK = frozenset({Fate.RELEASED, Fate.AMBIGUOUS})


class AnswerReader(Protocol):
    """How an upstream kind whose outcome lives inside the body reads an answer (MCP: the
    JSON-RPC response, proxy/mcp/outcome.py). One per call: it may keep state across reads."""

    def ends_stream(self, chunk: bytes) -> bool:
        """Whether this read completes the answer's terminal event (it waits for the commit)."""

    def verdict(self, status: int, body: bytes | None, streamed: bool) -> Verdict:
        """What the whole answer means for the key; ``body`` None when too large to keep."""


@dataclass(slots=True)
class CallResult:
    """How the call ended, for listeners."""
    fate: Fate
    problem: tuple[str, str] | None = None  # (slug, detail) when listeners get an error instead


@dataclass(eq=False, slots=True)
class Call:
    kid: str
    owner: str
    fingerprint: str
    upstream: UpstreamSettings
    on_ambiguous: OnAmbiguous
    max_record_bytes: int
    reader: AnswerReader | None = None  # None: the HTTP status decides (docs/concepts.md)
    max_record_seconds: float = float("inf")
    # what a quarantine keeps for the operator (evidence.py): bytes of the request's body and
    # of the answer's, each; the configured credential headers, masked with ours
    max_evidence_bytes: int = 0
    credential_headers: tuple[str, ...] = ()
    status: int = 0
    headers: list[tuple[str, str]] = field(default_factory=list)
    streamed: bool = False
    chunks: list[bytes] = field(default_factory=list)  # published so far
    result: CallResult | None = None
    upstream_s: float = 0.0  # time until the upstream's headers
    head_at: float = 0.0  # time.perf_counter() when they came (a whole answer's listeners wake later)
    listeners: int = 0  # requests being answered from this call now (replay.listen)
    answer: Recorded | None = None  # what was recorded, once committed (its model and usage)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _held: list[bytes] = field(default_factory=list)  # the last bytes, until the commit
    _gone: int = 0  # chunks let go from the front of ``chunks``
    _kept: int = 0  # bytes in ``chunks``
    # the record, as the upstream's bytes pass
    _recorded: bytearray = field(default_factory=bytearray)
    _timing: list[tuple[int, float]] = field(default_factory=list)  # see Recorded.timing
    _first_byte: float = 0.0  # time.perf_counter() at the first byte
    _too_large: bool = False  # over max_record_bytes or max_record_seconds: nothing more is kept
    _unrecordable: str = ""  # why, for the journal entry
    _record_until: float = float("inf")  # time.perf_counter() past which the record is given up
    _cut_off: bool = False  # unrecordable and unheard: we stopped reading before the end
    _line_start: bytes = b""  # the unfinished last line passed so far, while it is short
    _sharing: asyncio.Event | None = None  # streams: set when copying to the store must stop
    _length: tuple[str, str] | None = None  # a HEAD answer's Content-Length (kept_headers)
    _sent: tuple[list[tuple[str, str]], bytes] = ((), b"")  # the request, for a quarantine's evidence
    _first_bytes: bytearray = field(default_factory=bytearray)  # of the answer, up to max_evidence_bytes
    _answer_bytes: int = 0  # of the answer, read so far (for a quarantine's evidence)
    _given_back: Fate | None = None  # the head's status gives the key back: released before it is shown

    @property
    def gave_back(self) -> bool:
        """It gave the key back (at its head, or at its end): a duplicate claims it like any
        retry would."""
        return self._given_back is not None or (self.result is not None and self.result.fate in GIVEN_BACK)

    # -- listeners ------------------------------------------------------------------------

    async def headers_ready(self) -> None:
        while not self.status and self.result is None:
            await self._wait()

    async def finished(self) -> CallResult:
        while self.result is None:
            await self._wait()
        return self.result

    async def chunks_from(self, index: int) -> tuple[list[bytes], bool]:
        """Chunks after ``index`` (waiting for at least one), and whether that was all.

        Raises LookupError when they were let go (see ``_let_go``): the listener fell too
        far behind on a stream too large to keep.
        """
        while index >= self._gone + len(self.chunks) and self.result is None:
            await self._wait()
        if index < self._gone:
            raise LookupError("the stream moved on past this listener")
        return self.chunks[index - self._gone:], self.result is not None

    def _let_go(self) -> None:
        """Keep at most ``max_record_bytes`` of an unrecordable stream in memory."""
        while len(self.chunks) > 1 and self._kept > self.max_record_bytes:
            self._kept -= len(self.chunks[0])
            del self.chunks[0]
            self._gone += 1

    async def _wait(self) -> None:
        event = self._changed
        await event.wait()

    def _publish(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    # -- the call -------------------------------------------------------------------------

    async def run(self, pool: UpstreamPool, tenant: str, store: Store, method: str, target: str,
                  headers, body: bytes, heartbeat) -> None:
        """Make the call on one of ``tenant``'s upstream connections, and record its outcome."""
        try:
            self.result = await self._run(pool, tenant, store, method, target, headers, body, heartbeat)
        except asyncio.CancelledError:
            self.result = CallResult(Fate.FAILED, ("upstream-unavailable", "the proxy is shutting down"))
            raise
        except StoreUnavailable as exc:
            log.error("call %s: store unavailable: %s", self.kid[:12], exc)
            self.result = CallResult(Fate.UNSAVED, ("store-unavailable", f"the journal store failed: {exc}"))
        except Exception as exc:  # noqa: BLE001 - listeners must never hang
            log.exception("call %s failed", self.kid[:12])
            self.result = CallResult(Fate.FAILED, ("upstream-unavailable", f"proxy error: {exc!r}"))
        finally:
            self._publish()

    async def _run(self, pool: UpstreamPool, tenant: str, store: Store, method, target, headers, body,
                   heartbeat) -> CallResult:
        sent = time.perf_counter()
        self._record_until = sent + self.max_record_seconds
        if self.on_ambiguous is OnAmbiguous.QUARANTINE:
            self._sent = (headers, body)
        try:
            resp = await pool.request(method, target, headers, body, tenant=tenant)  # never resent
            try:
                self._begin(resp, time.perf_counter() - sent, method)
                if self._given_back is not None:
                    await store.journal.release(self.kid, self.owner)
                self._show_head()
                flusher = self._start_sharing(store)
                try:
                    while chunk := await resp.readany():
                        heartbeat()
                        self._take(chunk, resp)
                        if self._too_large and not self.listeners:
                            self._cut_off = True
                            resp.close()  # drops the connection: its pool slot is free again
                            break
                finally:
                    if flusher is not None:
                        self._sharing.set()  # stopped before the record: no shared bytes land after it
                        await asyncio.gather(flusher, return_exceptions=True)
            finally:
                resp.release()
        except Exception as exc:
            return await self._broken(store, exc)
        return await self._settle(store)

    def _begin(self, resp: UpstreamResponse, upstream_s: float, method: str) -> None:
        """The upstream's head: listeners may answer now (a stream from its first bytes)."""
        self.upstream_s = upstream_s
        self.head_at = time.perf_counter()
        self.status = resp.status
        self.headers = response_headers(resp.headers)
        if method == "HEAD":  # no body follows: its Content-Length is part of the answer (kept_headers)
            if resp.content_length is not None:
                self._length = ("Content-Length", str(resp.content_length))
                self.headers.append(self._length)
        else:
            self.streamed = is_stream(resp.headers)
            if (resp.content_length or 0) > self.max_record_bytes:
                self.streamed = True  # unrecordable anyway: pass it on without buffering it whole
        if self.reader is None:  # the status alone decides; an answer read by its body waits for it
            found = verdict(self.status)
            if found is Verdict.RELEASE:
                self._given_back = Fate.RELEASED
            elif found is Verdict.AMBIGUOUS and self.on_ambiguous is OnAmbiguous.RETRY:
                self._given_back = Fate.AMBIGUOUS

    def _show_head(self) -> None:
        """Listeners of a stream may answer now. A key this answer gives back was given back
        before: an agent that retries the moment it reads a 429's status line, its body unread,
        must find the key (and a derived key's occurrence) free, or the retry would take the
        next occurrence and shift every derived key after it."""
        if self.streamed:  # a whole answer's listeners wait for its end (replay._listen): no wake-up for them
            self._publish()

    def _take(self, chunk: bytes, resp: UpstreamResponse) -> None:
        """One read from the upstream: into the record, then on to listeners, unless it may
        be the end of the answer."""
        self._keep(chunk)
        if self.streamed and not self._held and not resp.at_eof() and not self._ends_stream(chunk):
            self._pass_on(chunk)
        else:  # the last bytes (and what follows them) wait for the commit
            self._held.append(chunk)

    def _keep(self, chunk: bytes) -> None:
        """Add to the record, up to ``max_record_bytes``: past that the answer is unrecordable."""
        if self.on_ambiguous is OnAmbiguous.QUARANTINE:
            self._answer_bytes += len(chunk)
            if len(self._first_bytes) < self.max_evidence_bytes:
                self._first_bytes += chunk[:self.max_evidence_bytes - len(self._first_bytes)]
        if self._too_large:
            return
        now = time.perf_counter()
        self._first_byte = self._first_byte or now
        if len(self._recorded) + len(chunk) > self.max_record_bytes:
            self._give_up(f"response over {self.max_record_bytes} bytes")
        elif now > self._record_until:
            self._give_up(f"response not finished within max_record_seconds ({self.max_record_seconds:g} s)")
        else:
            self._timing.append((len(self._recorded), round(now - self._first_byte, 4)))
            self._recorded += chunk

    def _give_up(self, why: str) -> None:
        """The answer cannot be recorded: it still passes to listeners, in bounded memory."""
        self._too_large = True
        self._unrecordable = why
        self._recorded.clear()
        if self._sharing is not None:
            self._sharing.set()  # it will be unrecordable: nothing to join

    def _ends_stream(self, chunk: bytes) -> bool:
        """Whether the chunk completes a terminal event, looking across reads:
        "data: [DO" + "NE]" is one."""
        if self.reader is not None:
            return self.reader.ends_stream(chunk)
        window = self._line_start + chunk
        rest = window[window.rfind(b"\n") + 1:]
        self._line_start = rest if len(rest) <= 32 else b"\0"  # too long to be one
        return TERMINAL_EVENT.search(window) is not None

    def _pass_on(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self._kept += len(chunk)
        if self._too_large:
            self._let_go()
        self._publish()

    async def _broken(self, store: Store, exc: Exception) -> CallResult:
        """The exchange with the upstream failed: nothing happened if the request was never
        sent; otherwise the outcome is ambiguous."""
        slug = failure_slug(exc)
        if never_sent(exc):
            await store.journal.release(self.kid, self.owner)
            return CallResult(Fate.RELEASED, (slug, f"no connection to {self.upstream.name} "
                                              f"({type(exc).__name__}); nothing was sent, the key is free"))
        return await self._ambiguous(store, slug, f"{type(exc).__name__} talking to {self.upstream.name}: {exc}")

    async def _settle(self, store: Store) -> CallResult:
        """The upstream answered in full: journal what its status calls for (docs/concepts.md)."""
        if self._given_back is not None:  # released at the head (_show_head)
            self._release_held(self._given_back)
            return CallResult(self._given_back)
        if self.reader is None:
            found = verdict(self.status)
        else:
            found = self.reader.verdict(self.status, None if self._too_large else bytes(self._recorded),
                                        self.streamed)
        if found is Verdict.RELEASE:
            await store.journal.release(self.kid, self.owner)
            return self._release_held(Fate.RELEASED)
        if found is Verdict.AMBIGUOUS:
            result = await self._ambiguous(store, None, f"upstream answered {self.status}")
            self._release_held(result.fate)
            return result
        if self._cut_off:  # a joiner must not take what was read for the whole answer
            why = f"{self._unrecordable}; nobody was listening, so it was not read to the end"
            await store.journal.mark_unrecordable(self.kid, self.owner, why)
            self._release_held(Fate.UNRECORDABLE)
            return CallResult(Fate.UNRECORDABLE, ("not-replayable", why))
        if self._too_large:
            await store.journal.mark_unrecordable(self.kid, self.owner, self._unrecordable)
            return self._release_held(Fate.UNRECORDABLE)
        return await self._commit(store)

    async def _commit(self, store: Store) -> CallResult:
        """Record the answer durably; only then do listeners get its last bytes (rule 1)."""
        record = Recorded(self.status, self.kept_headers(), bytes(self._recorded),
                          self.streamed, self._timing if self.streamed else [])
        self.answer = record
        try:
            kept = await store.journal.complete(self.kid, self.owner, record)
        except StoreUnavailable as exc:
            # Rule 1: the agent never sees an answer the journal does not hold.
            log.error("could not record %s: %s", self.kid[:12], exc)
            # Unconfirmed is not unwritten (a record its replicas did not confirm is on the master):
            # the detail promises only what a retry then gets.
            return CallResult(Fate.UNSAVED, ("store-unavailable", "the upstream answered but the journal "
                                             "could not confirm its record; a retry gets the journal's outcome: "
                                             "the answer if it was recorded, else what an expired claim gets "
                                             "once its lease ends"))
        if not kept:
            # Another proxy took the key over (our lease lapsed): its outcome is the journal's,
            # and the agent must not act on one the journal does not hold (rule 1).
            log.warning("lease on %s was lost before its record; the answer is withheld", self.kid[:12])
            return CallResult(Fate.UNSAVED, ("in-flight", "this proxy lost its claim on the key before "
                                             "it could record the answer; retry to get the journal's outcome"))
        return self._release_held(Fate.RECORDED)

    def kept_headers(self) -> list[tuple[str, str]]:
        """The answer's headers as the journal keeps them. A HEAD answer's Content-Length
        is kept: it is the length a GET would get (RFC 9110 §9.3.2), no body's framing."""
        kept = storable_headers(self.headers, self.upstream)
        return kept if self._length is None else [*kept, self._length]

    def _release_held(self, fate: Fate) -> CallResult:
        self.chunks.extend(self._held)
        self._held.clear()
        return CallResult(fate)

    async def _ambiguous(self, store: Store, slug: str | None, detail: str) -> CallResult:
        """The upstream may have acted: retry releases the key, quarantine keeps it unknown."""
        if self.on_ambiguous is OnAmbiguous.QUARANTINE:
            await store.journal.quarantine(self.kid, self.owner, detail, self._evidence())
            fate = Fate.QUARANTINED
        else:
            await store.journal.release(self.kid, self.owner)
            fate = Fate.AMBIGUOUS
        return CallResult(fate, (slug, detail) if slug else None)

    def _evidence(self) -> dict | None:
        """What the operator decides on (evidence.py); the answer's bytes as far as they came."""
        if not self.max_evidence_bytes:
            return None
        headers, body = self._sent
        return evidence(self.upstream, self.max_evidence_bytes, list(headers), body, self.status,
                        self.headers, bytes(self._first_bytes), self.credential_headers, self._answer_bytes)

    def _start_sharing(self, store: Store) -> asyncio.Task | None:
        if not self.streamed:
            return None
        self._sharing = asyncio.Event()
        return asyncio.create_task(share(self, store, self._sharing))
