"""Whether proxied calls are traced, decided from the standard ``OTEL_*`` variables.

Tracing is off unless the environment asks for it: ``OTEL_TRACES_EXPORTER=otlp``, or an
OTLP endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``)
with no exporter named; ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` turn it
off whatever else is set. When it is off, OpenTelemetry is never imported and the request
path has no span, middleware or client hook at all; when on, otel.py does the work
(it needs the ``otel`` extra).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Mapping

from ..config import ConfigError, Settings

if TYPE_CHECKING:
    from .otel import Tracing


def wanted(env: Mapping[str, str]) -> bool:
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = {e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()}
    if exporters:
        if exporters - {"otlp", "none"}:
            raise ConfigError(f"OTEL_TRACES_EXPORTER={','.join(sorted(exporters))}: idemproxy exports "
                              "traces over OTLP only (otlp or none)")
        return "otlp" in exporters
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def from_environment(settings: Settings, env: Mapping[str, str]) -> "Tracing | None":
    """The tracing of proxied calls the environment asks for, or None (the default)."""
    if not wanted(env):
        return None
    try:
        otel = import_module(f"{__package__}.otel")
    except ImportError as exc:
        raise ConfigError(f"tracing is asked for by OTEL_* variables but needs: pip install "
                          f"'idemproxy[otel]' ({exc})") from None
    return otel.Tracing(settings)
