"""Tool annotations, learned from the ``tools/list`` answers that pass through (docs/mcp.md).

A tool annotated ``readOnlyHint: true`` is a read: by default it goes upstream every time
(rule 3, replay reads). ``idempotentHint`` and ``destructiveHint`` steer the policy where the
upstream's configuration says so (``read_only_tools``, ``idempotent_tools``,
``non_destructive_tools``). A tool this proxy has not seen listed is recorded: not knowing is
no reason to run a side effect twice.

Annotations are kept per upstream and tenant (a server may list other tools to other
credentials), in this process's memory, newest listing wins.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ..config import Policy, UpstreamSettings
from .jsonrpc import EventSplitter, is_response, loads

MAX_TOOLS = 10_000  # annotations kept per process; the least recently listed go first
MAX_LISTING_BYTES = 4 * 1024 * 1024  # a larger tools/list answer is not read for annotations


def tool_policy(upstream: UpstreamSettings, annotations: dict[str, Any] | None) -> Policy:
    """The policy of a call to a tool with these annotations (None: never listed)."""
    if not annotations:
        return Policy.RECORD
    if annotations.get("readOnlyHint") is True:
        return Policy(upstream.read_only_tools)
    if annotations.get("idempotentHint") is True:
        return Policy(upstream.idempotent_tools)
    if annotations.get("destructiveHint") is False:
        return Policy(upstream.non_destructive_tools)
    return Policy.RECORD


class Catalog:
    def __init__(self) -> None:
        self._tools: OrderedDict[tuple[str, str, str], dict[str, Any]] = OrderedDict()

    def annotations(self, upstream: str, tenant: str, tool: str) -> dict[str, Any] | None:
        return self._tools.get((upstream, tenant, tool))

    def policy(self, upstream: UpstreamSettings, tenant: str, tool: str) -> Policy:
        """The policy of a call to ``tool`` (see :func:`tool_policy`)."""
        annotations = self._tools.get((upstream.name, tenant, tool))
        return tool_policy(upstream, annotations) if annotations else Policy.RECORD

    def listing(self, upstream: str, tenant: str) -> "Listing":
        """A tap for a ``tools/list`` answer on its way to the agent."""
        return Listing(self, upstream, tenant)

    def learn(self, upstream: str, tenant: str, result: Any) -> None:
        tools = result.get("tools") if isinstance(result, dict) else None
        for tool in tools if isinstance(tools, list) else ():
            if isinstance(tool, dict) and isinstance(tool.get("name"), str):
                key = (upstream, tenant, tool["name"])
                annotations = tool.get("annotations")
                self._tools[key] = annotations if isinstance(annotations, dict) else {}
                self._tools.move_to_end(key)
        while len(self._tools) > MAX_TOOLS:
            self._tools.popitem(last=False)


class Listing:
    """Reads a ``tools/list`` answer as it passes, JSON or SSE, and learns from its result."""

    def __init__(self, catalog: Catalog, upstream: str, tenant: str) -> None:
        self._catalog, self._upstream, self._tenant = catalog, upstream, tenant
        self._events = EventSplitter()
        self._body = bytearray()

    def __call__(self, chunk: bytes) -> None:
        if len(self._body) + len(chunk) > MAX_LISTING_BYTES:
            return
        self._body += chunk
        whole = loads(bytes(self._body)) if self._body[:1] in (b"{", b"[") else None
        messages = [whole] if whole is not None else [e.message for e in self._events.feed(chunk)]
        for message in messages:
            if is_response(message) and "result" in message:
                self._catalog.learn(self._upstream, self._tenant, message["result"])
