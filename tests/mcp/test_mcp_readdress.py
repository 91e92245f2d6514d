"""The shortcuts a replayed tools/call takes (proxy/mcp/readdress.py, messages.py) give the
bytes the long way gives: a recorded answer cut around its id and readdressed is the answer
parsed and written anew, and the MCP fingerprint hashed directly is the generic one."""

from __future__ import annotations

import json

import pytest

from idemproxy.proxy.fingerprint import fingerprint
from idemproxy.proxy.mcp.jsonrpc import dumps, loads
from idemproxy.proxy.mcp.messages import read
from idemproxy.proxy.mcp.readdress import MAX_CUT_ANSWER, Cuts, Readdress

RESULT = {"content": [{"type": "text", "text": "sent \"id\":1 \u00e9\u0000"}], "isError": False,
          "structuredContent": {"id": "probe", "n": 1.5e300}, "_meta": {}}
ANSWERS = [
    {"jsonrpc": "2.0", "id": "probe", "result": RESULT},
    {"id": 3, "jsonrpc": "2.0", "result": RESULT},  # the id first
    {"jsonrpc": "2.0", "result": RESULT, "id": None},  # the id last, null
    {"jsonrpc": "2.0", "result": RESULT},  # no id at all
    {"jsonrpc": "2.0", "id": 9, "error": {"code": -32602, "message": "bad"}},
    {"jsonrpc": "2.0", "id": 4, "result": {"big": 2 ** 70}},  # only the standard library writes it
]
CALLERS = [7, "7", "probe", 3, None, 2 ** 70, -1, "\u00e9\"x"]


def the_long_way(data: bytes, request_id) -> bytes:
    """What readdress.py did before answers were cut: parse, set the id, write."""
    message = loads(data)
    if message.get("id") == request_id:
        return data
    return dumps({**message, "id": request_id})


@pytest.mark.parametrize("answer", ANSWERS, ids=lambda a: str(list(a)))
@pytest.mark.parametrize("spaced", [False, True], ids=["compact", "spaced"])
def test_a_cut_answer_readdressed_is_the_answer_rewritten(answer, spaced):
    data = json.dumps(answer, indent=1 if spaced else None).encode()
    cuts = Cuts()
    for request_id in CALLERS * 2:  # the second time, from the cut remembered
        readdressed = Readdress(cuts, request_id).body(data)
        assert readdressed == the_long_way(data, request_id)
        assert loads(readdressed).get("id") == request_id


@pytest.mark.parametrize("data", [b"", b"not json", b"[1, 2]", b'{"jsonrpc":"2.0","method":"ping","id":1}',
                                  b"<html>502</html>"])
def test_what_is_not_a_response_passes_as_it_is(data):
    cuts = Cuts()
    assert Readdress(cuts, 7).body(data) == data
    assert Readdress(cuts, 7).body(data) == data


def test_a_large_answer_is_readdressed_without_being_remembered():
    data = dumps({"jsonrpc": "2.0", "id": 1, "result": {"text": "x" * MAX_CUT_ANSWER}})
    cuts = Cuts()
    assert Readdress(cuts, 2).body(data) == the_long_way(data, 2)
    assert cuts.of(b'{"jsonrpc":"2.0","id":1,"result":{}}') and len(cuts._cuts) == 1


@pytest.mark.parametrize("tenant", ["k:0123456789abcdef0123456789abcdef", "t:acme", "anonymous", "default",
                                    "t:true", "k:1"])
def test_the_mcp_fingerprint_is_the_generic_fingerprint_of_its_meaning(tenant):
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                       "params": {"name": "send_email", "arguments": {"to": "a@x", "n": [1, 2.5]},
                                  "_meta": {"progressToken": 3}}}).encode()
    call = read("POST", None, body)
    generic = fingerprint("MCP", "mcp", "/mcp?x=1", tenant.encode() + b"\0" + call.meaning, "")
    assert call.fingerprint("mcp", "/mcp?x=1", tenant) == generic
