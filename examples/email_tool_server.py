"""A tiny email sender: a tool with a real side effect and no deduplication of its own.

``POST /send`` with ``{"to", "subject", "body"}`` "sends" an email by appending it as one
JSON line to the outbox file, and answers ``201`` with the message id. Send the same
email twice and it is in the outbox twice: like most real tools (SMTP, a webhook, a
payment API without idempotency keys) it trusts its callers. ``GET /outbox`` lists
what was sent.

Behind idemproxy (upstream ``email`` in examples/config.toml) the proxy's journal is
what keeps a restarted agent from sending again.

    python examples/email_tool_server.py --port 9200 --outbox outbox.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from pathlib import Path

from aiohttp import web

OUTBOX = web.AppKey("outbox", Path)
FIELDS = ("to", "subject", "body")


async def send(request: web.Request) -> web.Response:
    try:
        email = await request.json()
    except ValueError:
        return web.json_response({"error": "the body must be JSON"}, status=400)
    if not isinstance(email, dict) or not all(isinstance(email.get(f), str) for f in FIELDS):
        return web.json_response({"error": f"send a JSON object with {', '.join(FIELDS)}"}, status=400)
    message = {"id": f"msg-{uuid.uuid4().hex[:12]}", "sent_at": time.time(),
               **{f: email[f] for f in FIELDS}}
    # The side effect: once this line is written the email is out, whatever happens next.
    with request.app[OUTBOX].open("a", encoding="utf-8") as outbox:
        outbox.write(json.dumps(message) + "\n")
    print(f"sent {message['id']} to {message['to']}", flush=True)
    return web.json_response({"id": message["id"], "status": "sent"}, status=201)


async def outbox(request: web.Request) -> web.Response:
    path = request.app[OUTBOX]
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    return web.json_response([json.loads(line) for line in lines if line])


def create_app(outbox_path: Path) -> web.Application:
    app = web.Application()
    app[OUTBOX] = outbox_path
    app.router.add_post("/send", send)
    app.router.add_get("/outbox", outbox)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9200)
    parser.add_argument("--outbox", type=Path, default=Path("outbox.jsonl"),
                        help="file the sent emails are appended to (default: outbox.jsonl)")
    args = parser.parse_args()
    print(f"email sender on http://{args.host}:{args.port}, outbox {args.outbox}", flush=True)
    web.run_app(create_app(args.outbox), host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
