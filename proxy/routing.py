"""Which upstream a request goes to, and with which run and epoch (SPEC §1).

Only configured upstreams are reachable. The raw request target is parsed without
decoding, then checked for escapes in every decoded form, so neither
``/openai/../admin`` nor ``/openai/%2e%2e/x`` nor ``%252e%252e`` leave the upstream's
base path on an upstream that decodes more than we do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping
from urllib.parse import unquote

from .config import UpstreamSettings
from .identity import parse_epoch, parse_run
from .problems import Problem

CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # in a decoded path: refused (_refuse_escapes)


@dataclass(frozen=True, slots=True)
class Route:
    upstream: UpstreamSettings
    run: str | None
    epoch: int | None
    path: str      # path below the upstream, starting with "/", still percent-encoded
    query: str     # raw query string, without "?"

    @property
    def path_qs(self) -> str:
        return f"{self.path}?{self.query}" if self.query else self.path


def parse_route(raw_target: str, upstreams: Mapping[str, UpstreamSettings]) -> Route:
    if not raw_target.startswith("/") or raw_target.startswith("//"):
        raise Problem("invalid-request", "only origin-form request targets are accepted; this is not an open proxy")
    path, _, query = raw_target.partition("?")
    path = path.partition("#")[0]
    _refuse_escapes(path)
    parts = path[1:].split("/", 5)
    run = epoch = None
    if parts[0] == "runs":
        if len(parts) < 3:
            raise Problem("not-found", "expected /runs/{run_id}/{upstream}/...")
        run = parse_run(parts[1])
        if parts[2] == "epochs":
            if len(parts) < 5:
                raise Problem("not-found", "expected /runs/{run_id}/epochs/{epoch}/{upstream}/...")
            epoch = parse_epoch(parts[3])
            parts = parts[4:]
        else:
            parts = parts[2:]
        parts = "/".join(parts).split("/", 1)
    else:
        parts = path[1:].split("/", 1)
    name = parts[0]
    upstream = upstreams.get(name)
    if upstream is None:
        raise Problem("unknown-upstream", f"no upstream named {name!r} is configured", upstream=name)
    rest = "/" + parts[1] if len(parts) > 1 else "/"
    return Route(upstream, run, epoch, rest, query)


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
        # route for a line break either; the front door asks us)
        if CONTROL.search(seen):
            raise Problem("invalid-request", "control characters in the path are refused")
        decoded = unquote(seen)
        if decoded == seen:
            return
        seen = decoded
    raise Problem("invalid-request", "path is encoded too many times")
