"""Which upstream a request goes to, and with which run and epoch (docs/guarantees.md, Paths).

Only configured upstreams are reachable. The raw request target is parsed without
decoding, then checked for escapes in every decoded form, so neither
``/openai/../admin`` nor ``/openai/%2e%2e/x`` nor ``%252e%252e`` leave the upstream's
base path on an upstream that decodes more than we do.

An absolute-form target (``POST http://proxyhost:8787/openai/v1/chat``), which a server
must accept (RFC 9112 §3.2.2), is taken when it names the proxy itself (``origin_form``),
and is then routed by its path and query alone: the proxy never connects to the
authority a target names, so it is never an open proxy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence
from urllib.parse import unquote

from .config import UpstreamSettings
from .identity import parse_epoch, parse_run
from .problems import Problem

CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # in a decoded path: refused (_refuse_escapes)
# absolute-URI (RFC 3986 §4.3) of an http or https target: scheme, authority, the rest
ABSOLUTE = re.compile(r"(https?)://([^/?#]*)(.*)", re.IGNORECASE | re.DOTALL)
NOT_OURS = "only targets naming this proxy are accepted; this is not an open proxy"
RUN_TOKEN_SEGMENT = re.compile(r"(/cap/)[^/]+")  # /runs/{run}[/epochs/{e}]/cap/{token}/...


def shown_path(path: str) -> str:
    """A path as logs show it: a run's token is a credential, never written down."""
    return RUN_TOKEN_SEGMENT.sub(r"\1***", path, count=1) if "/cap/" in path else path


@dataclass(frozen=True, slots=True)
class Route:
    upstream: UpstreamSettings
    run: str | None
    epoch: int | None
    path: str      # path below the upstream, starting with "/", still percent-encoded
    query: str     # raw query string, without "?"
    token: str | None = None  # the run's token from a /cap/{token} segment (identity.py)

    @property
    def path_qs(self) -> str:
        return f"{self.path}?{self.query}" if self.query else self.path


def origin_form(raw_target: str, hosts: Sequence[str]) -> str:
    """The target in origin form. An absolute-form one names the proxy itself when it is
    http or https without userinfo (RFC 9110 §4.2.4) and its authority is the request's one
    ``Host``, case aside: the authority a client must send as Host (RFC 9110 §7.2), and the
    one that stands for it (RFC 9112 §3.2.2). Such a request is exactly the origin-form one
    with that Host. Any other authority, or none, is refused: nothing is ever forwarded to
    the authority a target names."""
    if raw_target.startswith("/"):
        return raw_target
    absolute = ABSOLUTE.fullmatch(raw_target)
    if absolute is None:
        raise Problem("invalid-request", NOT_OURS)
    authority, rest = absolute.group(2), absolute.group(3)
    if (not authority or "@" in authority or len(hosts) != 1
            or authority.lower() != hosts[0].strip().lower()):
        raise Problem("invalid-request", NOT_OURS)
    return rest if rest.startswith("/") else "/" + rest  # "http://host" and "http://host?q" too


def parse_route(raw_target: str, upstreams: Mapping[str, UpstreamSettings]) -> Route:
    if not raw_target.startswith("/") or raw_target.startswith("//"):
        raise Problem("invalid-request", NOT_OURS)
    path, _, query = raw_target.partition("?")
    path = path.partition("#")[0]
    _refuse_escapes(path)
    parts = path[1:].split("/", 7)
    run = epoch = token = None
    if parts[0] == "runs":
        if len(parts) < 3:
            raise Problem("not-found", "expected /runs/{run_id}/{upstream}/...")
        run = parse_run(parts[1])
        parts = parts[2:]
        if parts[0] == "epochs":
            if len(parts) < 3:
                raise Problem("not-found", "expected /runs/{run_id}/epochs/{epoch}/{upstream}/...")
            epoch = parse_epoch(parts[1])
            parts = parts[2:]
        if parts[0] == "cap":  # the run's token: the attempt's traffic is the run's, whatever its credential
            if len(parts) < 3 or not parts[1]:
                raise Problem("not-found", "expected /runs/{run_id}[/epochs/{epoch}]/cap/{token}/{upstream}/...")
            token = parts[1]
            parts = parts[2:]
        parts = "/".join(parts).split("/", 1)
    else:
        parts = path[1:].split("/", 1)
    name = parts[0]
    upstream = upstreams.get(name)
    if upstream is None:
        raise Problem("unknown-upstream", f"no upstream named {name!r} is configured", upstream=name)
    rest = "/" + parts[1] if len(parts) > 1 else "/"
    return Route(upstream, run, epoch, rest, query, token)


def _refuse_escapes(path: str) -> None:
    if "." not in path and "%" not in path and "\\" not in path:
        return  # nothing that could spell an escape, in any encoding
    seen = path
    for _ in range(4):  # decode until stable: double encoding is a classic escape
        for segment in seen.replace("\\", "/").split("/"):
            # "..;x" is ".." to servlet containers, which drop ;matrix parameters
            if segment.partition(";")[0] in ("..", "."):
                raise Problem("invalid-request", "path segments '.' and '..' are refused")
        # a line break or another control character, encoded: no upstream path holds one, and
        # one that decodes it would split or rewrite the request line (aiohttp's router found no
        # route for a line break either; the data plane asks us)
        if CONTROL.search(seen):
            raise Problem("invalid-request", "control characters in the path are refused")
        decoded = unquote(seen)
        if decoded == seen:
            return
        seen = decoded
    raise Problem("invalid-request", "path is encoded too many times")
