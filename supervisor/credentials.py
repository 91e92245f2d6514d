"""What a command hook's agent will start without: ``idemproxy check`` says so before the
first restart finds out.

A command hook's agent inherits the supervisor's environment (hooks.py,
:func:`~.hooks.hook_environment`), not the shell its first attempt was started from. With the
provider keys exported in the agent's shell only, every restarted attempt had none: the SDK
refused to start ("Missing credentials") or its calls went out without a key. An upstream
whose credential the proxy injects (``set_headers``) needs none from agents; any other model
upstream of a well-known provider needs its well-known variable in the hook's environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import urlsplit

from ..proxy.config import Settings, UpstreamSettings
from .hooks import standby_environment

# provider: (the variable its SDK reads its key from, the host of its API)
WELL_KNOWN = {"openai": ("OPENAI_API_KEY", "api.openai.com"),
              "anthropic": ("ANTHROPIC_API_KEY", "api.anthropic.com")}
CREDENTIAL_HEADERS = frozenset({"authorization", "x-api-key", "api-key"})


def needed_variable(upstream: UpstreamSettings) -> str | None:
    """The variable an agent of ``upstream`` reads its key from, unless the proxy injects the
    credential; None for upstreams of no well-known provider."""
    if any(name.lower() in CREDENTIAL_HEADERS for name in upstream.set_headers):
        return None
    host = (urlsplit(upstream.url).hostname or "").lower()
    for provider, (variable, api_host) in WELL_KNOWN.items():
        if upstream.name == provider or host == api_host:
            return variable
    return None


def missing_credentials(settings: Settings, environ: Mapping[str, str] = os.environ) -> list[str]:
    """One warning per variable that command hooks' agents will start without, naming them."""
    needed: dict[str, list[str]] = {}
    for upstream in settings.upstreams.values():
        variable = needed_variable(upstream)
        if variable is not None:
            needed.setdefault(variable, []).append(f"[upstreams.{upstream.name}]")
    lacking: dict[str, list[str]] = {}
    for hook in settings.hooks.values():
        if hook.command:  # a webhook's agents get an environment of their own, elsewhere
            given = standby_environment(hook, environ)
            for variable in needed:
                if not given.get(variable):
                    lacking.setdefault(variable, []).append(hook.name)
    return [f"{', '.join(needed[variable])} injects no credential (set_headers) and "
            f"hook{'s' if len(hooks) > 1 else ''} {', '.join(hooks)} will not have {variable}: restarted "
            f"agents will start without a key. A hook's agent inherits the environment of the proxy (or "
            f"`idemproxy supervise`), not the agent's shell: export {variable} before starting it, name it "
            f"in the hook's env or pass_env, or have the proxy inject the key with set_headers"
            for variable, hooks in lacking.items()]
