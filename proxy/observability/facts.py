"""What the proxy learned about one proxied call, for its access-log line and its trace span.

The handler notes plain values as it goes (run, epoch, key, store time) and keeps a
reference to the answer; the model and token counts are read from the request and the
answer only when a JSON log line or a span asks for them, so the text log and a proxy
without tracing pay nothing for them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..store.model import Recorded
from .metrics import MODEL, usage

@dataclass(slots=True)
class Facts:
    upstream: str
    run: str | None = None
    epoch: int | None = None
    kid: str | None = None
    key_kind: str | None = None  # "explicit" (the agent's Idempotency-Key), "derived", "fingerprint"
    store_s: float = 0.0  # time spent waiting on the store before forwarding or answering
    body: bytes = b""  # the request body, for the model it names
    answer: Recorded | None = None  # the answer as recorded (a replay's, or the call's own)
    _tokens: dict[str, int] | None = field(default=None, repr=False)

    def timed(self, since: float) -> None:
        """Add the store time since ``since`` (a time.perf_counter())."""
        self.store_s += time.perf_counter() - since

    @property
    def model(self) -> str | None:
        """The model the request asked for (``gen_ai.request.model``), else the answer's."""
        for text in (self.body, self.answer.body if self.answer is not None else b""):
            found = MODEL.search(text[:65536])
            if found:
                return found.group(1).decode(errors="replace")
        return None

    @property
    def tokens(self) -> dict[str, int]:
        """Token counts from the answer's ``usage`` (OpenAI and Anthropic field names)."""
        if self._tokens is None:
            self._tokens = usage(self.answer) if self.answer is not None else {}
        return self._tokens

    @property
    def input_tokens(self) -> int | None:
        t = self.tokens
        return t.get("prompt_tokens", t.get("input_tokens"))

    @property
    def output_tokens(self) -> int | None:
        t = self.tokens
        return t.get("completion_tokens", t.get("output_tokens"))


KEY_KINDS = {"key": "explicit", "derived": "derived", "fingerprint": "fingerprint"}


def key_kind(scope_key: str) -> str:
    """How a request's journal key was made (docs/concepts.md), from its scope's key: the agent's own
    ``Idempotency-Key`` (explicit), derived in its run, or its fingerprint alone."""
    return KEY_KINDS.get(scope_key.partition(":")[0], "derived")
