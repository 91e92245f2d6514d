"""MCP upstreams (docs/mcp.md): ``tools/call`` journaled over Streamable HTTP, everything else
passed through.

    jsonrpc.py      JSON-RPC messages, in a POST body or in server-sent events
    messages.py     what a POST asks for, and what a tools/call means (its key material)
    catalog.py      tool annotations learned from tools/list, and the policy they give
    occurrences.py  an undelivered call re-issued is the same call, not the next one
    outcome.py      what an answer to tools/call means for its journal entry
    readdress.py    a recorded answer (cut once around its id) and the proxy's refusals under the
                    caller's own JSON-RPC id and progress token
    upstream.py     the steps Proxy._mcp (proxy/request_path/handler.py) takes with them
"""

from .outcome import ToolAnswer
from .upstream import McpUpstreams, journaled_path

__all__ = ["McpUpstreams", "ToolAnswer", "journaled_path"]
