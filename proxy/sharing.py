"""A recorded stream shared with other proxies as it passes: their duplicates of the call
join it from the store (replay.join_remote) instead of waiting for its end."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Protocol

import orjson

from .store import Store, StoreUnavailable

log = logging.getLogger("idemproxy.proxy")

PARTIAL_FLUSH_S = 0.1  # how often stream bytes are shared with other proxies
# A stream with nothing new to share shares nothing this often: a joiner on another proxy
# takes it as a sign that its proxy lives, and the bytes so far as those of a live stream
# (replay.join_remote), however long the upstream is silent.
ALIVE_S = 1.0


class Shared(Protocol):
    """A recorded call in flight whose answer is a stream (calls.Call)."""
    kid: str
    owner: str
    status: int
    chunks: list[bytes]  # published so far

    def kept_headers(self) -> list[tuple[str, str]]: ...


async def share(call: Shared, store: Store, done: asyncio.Event) -> None:
    """Copy the call's stream to the store as it passes, until ``done``; while it is quiet,
    an empty piece every ``ALIVE_S``."""
    seq, sent = 0, 0
    try:
        await store.journal.append_partial(call.kid, call.owner, 0, orjson.dumps(
            {"status": call.status, "headers": call.kept_headers()}))
        shared_at = time.monotonic()
        while not done.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(done.wait(), PARTIAL_FLUSH_S)
            quiet = time.monotonic() - shared_at >= ALIVE_S
            if (len(call.chunks) > sent or quiet) and not done.is_set():
                seq += 1
                data = b"".join(call.chunks[sent:])
                sent = len(call.chunks)
                await store.journal.append_partial(call.kid, call.owner, seq, data)
                shared_at = time.monotonic()
    except StoreUnavailable as exc:
        log.warning("stream %s not shared with other proxies: %s", call.kid[:12], exc)
