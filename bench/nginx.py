"""The fast provider: nginx answering a fixed chat completion from memory.

The Python fake provider spends about as much CPU per request as the proxy in front of it,
on the same two cores, and so hides part of the proxy's own cost. nginx answers
``POST /v1/chat/completions`` with a constant body (``return 200 '...'``) in a few
microseconds. Install it from Debian's packages (``apt-get install -y nginx-light``); the
benchmark installs nothing. It starts its own nginx with a generated configuration in its
temporary folder, on a free port, in the foreground, and stops it with the other servers.

Upstream calls are counted with ``stub_status`` (``GET /_calls``): its ``requests`` counter
is every request nginx has served, the reads of the counter included, so the reads made
are subtracted (:class:`CallCounter`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

CHAT_PATH = "/v1/chat/completions"
# A short, realistic non-streaming answer (a 2026-era OpenAI chat.completion, ~450 bytes).
COMPLETION = json.dumps({
    "id": "chatcmpl-bench0000000000000000000000", "object": "chat.completion", "created": 1764547200,
    "model": "gpt-bench", "system_fingerprint": "fp_bench",
    "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                 "message": {"role": "assistant", "content": "Hello there, friend.", "refusal": None}}],
    "usage": {"prompt_tokens": 21, "completion_tokens": 5, "total_tokens": 26},
}, separators=(",", ":"))
INSTALL_HINT = "nginx is not installed: apt-get install -y nginx-light (or nginx), or use --provider python"


def executable() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).is_file()), None)


def config(port: int, prefix: Path) -> str:
    """One worker, in the foreground, logging errors only; everything in ``prefix``."""
    body = COMPLETION.replace("\\", "\\\\").replace("'", "\\'")
    return f"""daemon off;
master_process on;
worker_processes 1;
pid {prefix}/nginx.pid;
error_log stderr warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    keepalive_requests 1000000;
    keepalive_timeout 300s;
    server {{
        listen 127.0.0.1:{port} reuseport backlog=1024;
        location = {CHAT_PATH} {{
            default_type application/json;
            return 200 '{body}';
        }}
        location = /_calls {{ stub_status; }}
        location / {{ return 404; }}
    }}
}}
"""


def write_config(port: int, workdir: Path) -> Path:
    prefix = workdir / "nginx"
    prefix.mkdir(exist_ok=True)
    path = prefix / "nginx.conf"
    path.write_text(config(port, prefix))
    return path


def argv(conf: Path) -> list[str]:
    exe = executable()
    if exe is None:
        raise FileNotFoundError(INSTALL_HINT)
    return [exe, "-p", str(conf.parent), "-c", str(conf), "-e", "stderr"]


class CallCounter:
    """Chat completions nginx has answered: stub_status's ``requests`` less its own reads."""

    def __init__(self) -> None:
        self.reads = 0

    def count(self, status_text: str) -> int:
        self.reads += 1
        # "Active connections: 1 \nserver accepts handled requests\n 5 5 17 \nReading: ..."
        requests = int(status_text.splitlines()[2].split()[2])
        return requests - self.reads
