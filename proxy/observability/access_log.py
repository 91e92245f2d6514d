"""The access log: one line per request at INFO (``idemproxy.access``), plain or JSON, with what
the proxy did with it and where its time went."""

from __future__ import annotations

import logging

import orjson
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from ..config import Settings
from ..connections import REFUSAL
from ..exchange import EXCHANGE
from ..routing import shown_path


class AccessLogger(AbstractAccessLogger):
    """One line per request at INFO, with what the proxy did with it (durations to the µs)."""

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)

    def log(self, request: web.BaseRequest, response: web.StreamResponse, duration: float) -> None:
        refused = request.get(REFUSAL)
        if refused is not None:  # aiohttp's parser refused it: no method or path to show
            self.logger.info("%s - - %d rejected %.3fms malformed HTTP: %s", request.remote,
                             response.status, duration * 1000, refused)
            return
        exchange = request.get(EXCHANGE)
        self.logger.info("%s %s %s %d %s %.3fms", request.remote, request.method, shown_path(request.path),
                         response.status, exchange.outcome if exchange is not None else "-", duration * 1000)


class JsonAccessLogger(AccessLogger):
    """``[server] log_format = "json"``: one JSON object per request, for a log pipeline."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, duration: float) -> None:
        self.logger.info("%s", access_record(request, response, duration))


def access_logger(settings: Settings) -> type[AccessLogger]:
    return JsonAccessLogger if settings.server.log_format == "json" else AccessLogger


def access_record(request: web.BaseRequest, response: web.StreamResponse, duration: float) -> str:
    """The request as one JSON object: what it was, what the proxy did, and where time went."""
    exchange = request.get(EXCHANGE)
    line = {"remote": request.remote, "method": request.method, "path": shown_path(request.path),
            "status": response.status, "outcome": exchange.outcome if exchange is not None else None,
            "ms": round(duration * 1000, 3)}
    facts = exchange.facts if exchange is not None else None
    if facts is not None:
        upstream_s = exchange.upstream_s
        line.update(upstream=facts.upstream, run=facts.run, epoch=facts.epoch, kid=facts.kid,
                    key_kind=facts.key_kind, model=facts.model,
                    input_tokens=facts.input_tokens, output_tokens=facts.output_tokens,
                    store_ms=round(facts.store_s * 1000, 3),
                    upstream_ms=None if upstream_s is None else round(upstream_s * 1000, 3),
                    proxy_ms=round((duration - (upstream_s or 0.0)) * 1000, 3))
    return orjson.dumps(line).decode()
