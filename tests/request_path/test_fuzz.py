"""Fuzzing a live proxy: generated paths, headers, keys and bodies.

Whatever comes in, the proxy never answers 500, never logs a traceback or an error,
never forwards a request it refused, and never replays a record for a different request.
"Different" is judged here, independently of the proxy's fingerprint: two bodies are the
same request only if their bytes are equal, or both are JSON-typed JSON (no key given
twice, no NaN or Infinity) with equal values, numbers compared exactly.

Every request goes over a raw socket (so header bytes are ours) to a proxy on the product
default (credential-less calls are refused), and every forwarded one reaches the fake
provider's echo route, which answers with the request's `X-Fuzz-Seq`: a replay says which
earlier request it came from. Deterministic by default (derandomize); more examples with
IDEMPROXY_FUZZ_EXAMPLES=5000.
"""

from __future__ import annotations

import asyncio
import gzip
import itertools
import json
import logging
import os
import random
import string
import zlib
from dataclasses import dataclass
from decimal import Decimal
from typing import Any
from urllib.parse import urlsplit

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from idemproxy.proxy.identity import parse_key
from idemproxy.proxy.problems import Problem
from idemproxy.proxy.routing import parse_route
from scripted_upstream import ScriptedUpstream, replying

EXAMPLES = int(os.environ.get("IDEMPROXY_FUZZ_EXAMPLES", "150"))
LIMIT = 32 * 1024  # max_request_bytes of the fuzzed proxy: "huge" bodies stay quick
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large, HealthCheck.large_base_example])
pytestmark = pytest.mark.timeout(60 + EXAMPLES // 5)
SEQ = itertools.count()


# -- bodies: JSON text with odd spellings, as a tree so that one can be written two ways ---------

# Tokens that read alike but are not all the same value: a mutation swaps one for another.
ALIASES = [["1e2", "100.0", "1E+2", "100.00", "100"], ["0.1", "0.10", "1e-1"], ["1", "1.0"],
           ["-0.0", "0.0", "0"], ["null", "NaN", "Infinity", "-Infinity"],
           ["0.12345678901234567", "0.12345678901234566"], ["1e-400", "0.0", "1.5e-320"],
           ["9007199254740993", "9007199254740992"], ["123456789012345678901234567890",
                                                      "123456789012345678901234567891", "1e400"],
           ['"a"', '"\\u0061"', '"A"'], ['"\\ud800"', '"\\ud801"', '"\\ud83d\\ude00"', '"😀"'],
           ['":"', '"\\u003a"', '"x:y"', '"x"']]
KEYS = ['"a"', '"b"', '"\\u0061"', '"a:"', '"a\\u003a"', '"model"', '""']

scalar = (st.sampled_from([t for group in ALIASES for t in group] + ["true", "false", '"\\\\"', '"\\""'])
          | st.integers(-(2 ** 70), 2 ** 70).map(str)
          | st.floats(allow_nan=False, allow_infinity=False).map(repr)
          | st.text(max_size=8).map(lambda s: json.dumps(s, ensure_ascii=len(s) % 2 == 0)))
tree = st.recursive(scalar, lambda kids: st.lists(kids, max_size=4).map(lambda xs: ("[]", xs))
                    | st.lists(st.tuples(st.sampled_from(KEYS), kids), max_size=4).map(lambda kv: ("{}", kv)),
                    max_leaves=10)


def render(node: Any, rng: random.Random) -> str:
    """One way of writing ``node``: whitespace and key order are the writer's choice."""
    def gap() -> str:
        return rng.choice(["", "", " ", "\n  ", "\t"])
    if isinstance(node, str):
        return node
    kind, items = node
    if kind == "[]":
        return "[" + gap() + ("," + gap()).join(render(item, rng) for item in items) + gap() + "]"
    keys = [k for k, _ in items]
    if len(set(keys)) == len(keys):  # reordering is meaningless with a key given twice
        items = rng.sample(items, len(items))
    return "{" + gap() + ",".join(f"{k}{gap()}:{gap()}{render(v, rng)}" for k, v in items) + gap() + "}"


def mutate(node: Any, rng: random.Random) -> Any:
    """The same tree with at most one token swapped for an alias, or a key given twice."""
    if isinstance(node, str):
        group = next((g for g in ALIASES if node in g), None)
        return rng.choice(group) if group else node
    kind, items = node
    if not items:
        return node
    i = rng.randrange(len(items))
    items = list(items)
    if kind == "{}" and rng.random() < 0.3:
        items.append(items[i])
    elif kind == "{}":
        items[i] = (items[i][0], mutate(items[i][1], rng))
    else:
        items[i] = mutate(items[i], rng)
    return kind, items


def deep(depth: int, leaf: str) -> str:
    return "[" * depth + leaf + "]" * depth


odd_bytes = st.one_of(
    st.binary(max_size=40),                                        # mostly invalid UTF-8
    st.integers(200, 1100).map(lambda n: deep(n, "1").encode()),   # past MAX_DEPTH, past the parsers
    st.integers(LIMIT - 40, 3 * LIMIT).map(lambda n: b'{"pad": "' + b"x" * n + b'"}'),  # near and past the limit
    st.sampled_from([b"\xef\xbb\xbf{}", b'{"a": 1} {"a": 1}', b'{"a": 1,}', b"'a'", b"", b" "]),
)
bodies = tree.map(lambda t: render(t, random.Random(0)).encode()) | odd_bytes
content_types = st.sampled_from(["application/json", "Application/JSON; charset=utf-8", "application/vnd.x+json",
                                 "APPLICATION/MERGE-PATCH+JSON", "text/plain", "application/x-ndjson",
                                 "multipart/form-data; boundary=x", "application/json;;;", "a/b/c", None])


# -- requests -------------------------------------------------------------------------------------

TOKEN = string.ascii_letters + string.digits + "!#$%&'*+-.^_`|~"
VALUE = "".join(chr(c) for c in range(0x20, 0x7f)) + "\x80\xa0\xe9\xff\t"  # visible, space, tab, obs-text
segment = st.text(alphabet=string.ascii_letters + string.digits + "-._~%:@!$&'()*+,;=", max_size=10)
targets = st.one_of(
    st.tuples(st.sampled_from(["/raw/echo/", "/runs/r1/raw/echo/", "/runs/r-2/epochs/3/raw/echo/"]),
              st.lists(segment, max_size=3), st.none() | segment)
    .map(lambda t: t[0] + "/".join(t[1]) + (f"?{t[2]}" if t[2] is not None else "")),
    st.sampled_from(["/raw/echo/../../admin/runs", "/raw/echo/%2e%2e/%2e%2e/admin", "/raw//echo", "/nope/echo/x",
                     "/runs/bad%20id/raw/echo", "/raw/echo/%zz", "/raw/echo/%00", "/raw/echo/caf%C3%A9",
                     "/raw/echo/%ff", "//raw/echo", "/raw/echo/x?a=1&a=2", "/runs/r1/epochs/x/raw/echo",
                     "/runs/r1/epochs/99999999999999999999/raw/echo/x", "/raw/echo/x#frag", "/raw"]),
)
keys = st.none() | st.sampled_from(["k1", '"k1"', "k2", '"k\\"2"', "a,b", '"a", "b"', "", " ", "x" * 256,
                                    '"unterminated', "caf\xe9", "\x80"]) | st.text(VALUE, min_size=1, max_size=20)
optional_headers = {
    "Idem-Run": st.sampled_from(["r1", "r-2", "bad id", "x" * 129, "r1,r2", "\xe9"]),
    "Idem-Epoch": st.sampled_from(["0", "1", "2", "-1", "1.5", " 3 ", "99999999999999999999", "x"]),
    "Idem-Policy": st.sampled_from(["record", "passthrough", "RECORD", "bogus", ""]),
    "Idem-Tenant": st.sampled_from(["acme", "bad tenant"]),  # the fuzzed proxy trusts no source
    "Authorization": st.sampled_from(["Bearer a", "Bearer b", "", "Bearer \xe9"]),
    "Cookie": st.sampled_from(["session=a", "session=b"]),
    "Idem-Replay": st.sampled_from(["paced", "x"]),
}


@dataclass
class Request:
    seq: int
    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)


@st.composite
def requests(draw) -> Request:
    headers = [(name, draw(value)) for name, value in optional_headers.items() if draw(st.booleans())]
    key = draw(keys)
    if key is not None:
        headers.append(("Idempotency-Key", key))
        if draw(st.integers(0, 9)) == 0:
            headers.append(("Idempotency-Key", key))  # two field lines
    if (ctype := draw(content_types)) is not None:
        headers.append(("Content-Type", ctype))
    headers += draw(st.lists(st.tuples(st.text(TOKEN, min_size=1, max_size=12).filter(_not_framing),
                                       st.text(VALUE, max_size=20)), max_size=3))
    method = draw(st.sampled_from(["POST", "POST", "PUT", "PATCH", "DELETE", "GET", "HEAD"]))
    return Request(next(SEQ), method, draw(targets), headers, draw(bodies))


def _not_framing(name: str) -> bool:  # framing is the HTTP parser's business, not the proxy's
    return name.lower() not in ("content-length", "transfer-encoding", "connection", "host", "expect",
                                "x-fuzz-seq", "upgrade")


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


async def send(url: str, req: Request) -> Answer:
    """One request on its own connection, the head written byte for byte as generated."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    head = [f"{req.method} {req.target} HTTP/1.1", f"Host: {parts.netloc}", f"X-Fuzz-Seq: {req.seq}",
            *(f"{k}: {v}" for k, v in req.headers), f"Content-Length: {len(req.body)}", "Connection: close"]
    try:
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + req.body)
        try:
            await writer.drain()
        except ConnectionError:  # refused before the body was read: the answer is still there
            pass
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except ConnectionError:
            pass
    head_block, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head_block.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return Answer(int(status_line.split()[1]), headers, body)


# -- the independent judge of "the same request" -------------------------------------------------

def is_json_type(ctype: str | None) -> bool:
    media = (ctype or "").split(";")[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def strict(body: bytes) -> Any:
    """The value of a JSON body, numbers exact (int, Decimal); raises for a key given twice
    or NaN and Infinity, which JSON parsers read in different ways."""
    def unique(pairs):
        if len({k for k, _ in pairs}) != len(pairs):
            raise ValueError("key given twice")
        return dict(pairs)

    def refuse(token):
        raise ValueError(token)
    return json.loads(body.decode("utf-8"), object_pairs_hook=unique, parse_float=Decimal, parse_constant=refuse)


def same_value(a: Any, b: Any) -> bool:
    """Equal JSON values, telling 1 from 1.0 and true from 1."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return a == b


def same_body(a: bytes, a_type: str | None, b: bytes, b_type: str | None) -> bool:
    if a == b:
        return True
    if not (is_json_type(a_type) and is_json_type(b_type)):
        return False
    try:
        return same_value(strict(a), strict(b))
    except (ValueError, RecursionError):
        return False


# -- the checks ----------------------------------------------------------------------------------

class Logged(logging.Handler):
    """Everything at WARNING or above, from every logger."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def logged():
    handler = Logged()
    logging.getLogger().addHandler(handler)
    yield handler.records
    logging.getLogger().removeHandler(handler)


class Journal:
    """What was sent to one proxy (over all examples: its journal outlives them), and the
    checks every answer must pass."""

    def __init__(self, proxy, provider, logged: list[logging.LogRecord]):
        self.proxy, self.provider, self.logged = proxy, provider, logged
        self.sent: dict[int, Request] = {}

    async def send(self, req: Request) -> Answer:
        calls = sum(self.provider.calls.values())
        answer = await send(self.proxy.url, req)
        self.sent[req.seq] = req
        forwarded = sum(self.provider.calls.values()) - calls
        assert answer.status != 500 and answer.status < 600, (answer.status, answer.body[:300], req)
        if answer.headers.get("content-type", "").startswith("application/problem+json"):
            assert forwarded == 0, ("refused but forwarded", answer.body[:300], req)
            assert req.method == "HEAD" or orjson.loads(answer.body)["status"] == answer.status
        if answer.headers.get("idempotent-replayed") == "true":
            assert forwarded == 0, req
            self.check_replay(req, answer)
        troubles = [r for r in self.logged if r.levelno >= logging.ERROR or r.exc_info]
        assert not troubles, [(r.name, r.getMessage(), r.exc_info) for r in troubles]
        return answer

    def check_replay(self, req: Request, answer: Answer) -> None:
        try:
            seq = int(orjson.loads(answer.body)["headers"]["X-Fuzz-Seq"])
        except (ValueError, KeyError, TypeError):  # not an echo: some earlier request must match
            earlier = [r for r in self.sent.values() if r is not req]
            assert any(self.same_request(r, req) for r in earlier), req
            return
        assert seq != req.seq and self.same_request(self.sent[seq], req), ("replayed another request's record",
                                                                            self.sent[seq], req)

    def same_request(self, a: Request, b: Request) -> bool:
        scope = self.scope(a)
        return scope is not None and scope == self.scope(b) and same_body(
            a.body, a.header("Content-Type"), b.body, b.header("Content-Type"))

    def scope(self, req: Request) -> tuple | None:
        """Whose record a request may be answered from: credential, run, upstream, path, key."""
        settings = self.proxy.settings
        try:
            route = parse_route(req.target.partition("#")[0], settings.upstreams)  # as aiohttp's raw_path
            key = parse_key([v for k, v in req.headers if k.lower() == "idempotency-key"])
        except Problem:
            return None
        credential = tuple(req.header(h) for h in settings.tenants.credential_headers)
        return credential, route.run or req.header("Idem-Run"), route.upstream.name, route.path_qs, key, req.method


@pytest.fixture
async def journal(make_proxy, sqlite_url, provider, logged) -> Journal:
    proxy = await make_proxy(sqlite_url, tenants={"anonymous": "refuse"}, server={"max_request_bytes": LIMIT})
    return Journal(proxy, provider, logged)


@pytest.mark.slow
@given(reqs=st.lists(requests(), min_size=1, max_size=3))
@FUZZ
async def test_generated_requests_never_break_the_proxy(journal, reqs):
    for req in reqs:
        await journal.send(req)
        await journal.send(Request(next(SEQ), req.method, req.target, req.headers, req.body))  # and again


@pytest.mark.slow
@given(tree=tree, seeds=st.tuples(st.integers(0, 2 ** 32), st.integers(0, 2 ** 32)), mutated=st.booleans(),
       types=st.tuples(content_types, content_types), explicit_key=st.booleans())
@FUZZ
async def test_two_bodies_at_one_position_never_share_a_record(journal, tree, seeds, mutated, types,
                                                             explicit_key):
    """Body A in one attempt, body B (A written another way, or changed a little) at the same
    position in the next attempt, or under the same key: B is replayed only if it is A."""
    a = render(tree, random.Random(seeds[0])).encode()
    b = render(mutate(tree, random.Random(seeds[1])) if mutated else tree, random.Random(seeds[1])).encode()
    run = f"pair-{next(SEQ)}"
    key = [("Idempotency-Key", run)] if explicit_key else []
    sent = []
    for epoch, body, ctype in ((0, a, types[0]), (1, b, types[1])):
        headers = [("Authorization", "Bearer a"), ("Idem-Run", run), ("Idem-Epoch", str(epoch)), *key]
        headers += [("Content-Type", ctype)] if ctype else []
        req = Request(next(SEQ), "POST", "/raw/echo/pair", headers, body)
        sent.append(await journal.send(req))
    first, second = sent
    assert first.status == 200 and first.headers["idempotent-replayed"] == "false"
    if a == b and types[0] == types[1]:  # the same request: replayed, so the test can see a replay
        assert second.headers.get("idempotent-replayed") == "true", (a, types)
    if explicit_key and second.status != 200:  # not replayed: the key was used with another request
        assert second.status == 422, second


# -- compressed bodies ----------------------------------------------------------------------------

def _deflate_bare(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


PACKERS = {"gzip": gzip.compress, "x-gzip": gzip.compress, "deflate": zlib.compress, "deflate-bare": _deflate_bare}
damages = st.none() | st.tuples(st.sampled_from(["cut", "flip", "append"]), st.integers(0, 1 << 20),
                                st.binary(min_size=1, max_size=8))


def damaged(packed: bytes, damage: tuple[str, int, bytes] | None) -> bytes:
    if damage is None or not packed:
        return packed
    how, at, junk = damage
    at %= len(packed)
    if how == "cut":
        return packed[:at]
    if how == "flip":
        return packed[:at] + bytes([packed[at] ^ (junk[0] or 0xFF)]) + packed[at + 1:]
    return packed + junk


def unpacked(body: bytes, codings: list[str]) -> bytes | None:
    """The content, decoded by the standard library (gzip members, a zlib or bare deflate
    stream with nothing after it); None when it cannot be decoded. An empty body is empty
    content whatever its coding says (a client may name one on every request)."""
    if not body:
        return body
    try:
        for coding in reversed(codings):
            if coding.endswith("gzip"):
                body = gzip.decompress(body)
                continue
            inflater = zlib.decompressobj(zlib.MAX_WBITS if body[:1] and body[0] & 0x0F == 8 else -zlib.MAX_WBITS)
            body = inflater.decompress(body)
            if not inflater.eof or inflater.unused_data:
                return None
    except (OSError, EOFError, zlib.error, IndexError):  # gzip.BadGzipFile is an OSError
        return None
    return body


@pytest.fixture
async def packed_upstream(make_proxy, sqlite_url, logged):
    """A proxy whose upstream ``packed`` keeps every request's bytes as it received them."""
    upstream = ScriptedUpstream(default=replying(lambda _target: b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"))
    await upstream.start()
    proxy = await make_proxy(sqlite_url, server={"max_request_bytes": LIMIT},
                             upstreams__packed={"url": upstream.url, "kind": "tool"})
    yield proxy, upstream
    await upstream.close()


@pytest.mark.slow
@given(content=bodies, packers=st.lists(st.sampled_from(sorted(PACKERS)), min_size=1, max_size=2),
       damage=damages, recorded=st.booleans())
@FUZZ
async def test_compressed_bodies_go_upstream_as_received_or_are_refused(packed_upstream, logged, content,
                                                                          packers, damage, recorded):
    """A body decodable to at most the limit goes upstream byte for byte with its coding; one
    that cannot be decoded (as the standard library judges it) is a 400 or 413, never forwarded;
    a damaged one that still decodes may go either way. Never a 500, never a logged error."""
    proxy, upstream = packed_upstream
    codings = [p.removesuffix("-bare") for p in packers]
    body = content
    for packer in packers:
        body = PACKERS[packer](body)
    body = damaged(body, damage)
    policy = ("Idempotency-Key", f"fuzz-{next(SEQ)}") if recorded else ("Idem-Policy", "passthrough")
    headers = [("Content-Type", "application/json"), ("Content-Encoding", ", ".join(codings)), policy]
    before = len(upstream.requests)
    answer = await send(proxy.url, Request(next(SEQ), "POST", "/packed/send", headers, body))
    forwarded = upstream.requests[before:]
    troubles = [r for r in logged if r.levelno >= logging.ERROR or r.exc_info]
    assert not troubles, [(r.name, r.getMessage()) for r in troubles]
    decodes = unpacked(body, codings)
    if answer.status == 200:
        assert decodes is not None and len(decodes) <= LIMIT and len(body) <= LIMIT, (answer, codings, damage)
        assert len(forwarded) == 1 and forwarded[0].body == body
        assert f"\r\ncontent-encoding: {', '.join(codings)}\r\n".encode() in forwarded[0].head.lower()
        return
    assert forwarded == [], answer
    slug = orjson.loads(answer.body)["type"].rsplit("/", 1)[-1]
    too_large = len(body) > LIMIT or (decodes is not None and len(decodes) > LIMIT)
    assert (answer.status, slug) in ((400, "undecodable-body"), (413, "too-large")), answer
    if decodes is not None and damage is None:  # a valid body is refused only for its size
        assert too_large and slug == "too-large", (answer, codings)
