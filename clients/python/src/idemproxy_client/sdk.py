"""Ready clients of popular SDKs, pointed at the proxy's run-scoped base URL.

The SDKs are optional extras (``idemproxy-client[openai]``, ``[anthropic]``,
``[aiohttp]``) and imported only when asked for.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    import aiohttp
    import anthropic
    import openai

# Sent when the agent holds no key because the proxy injects the real credential
# (an upstream's ``set_headers``): the SDKs refuse to start without one.
PLACEHOLDER_API_KEY = "idemproxy-injected"


def _require(module: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{module} is not installed: pip install 'idemproxy-client[{extra}]'") from exc


def _sdk_kwargs(kwargs: dict[str, Any], base_url: str, headers: Mapping[str, str],
                key_variable: str) -> dict[str, Any]:
    kwargs = dict(kwargs)
    kwargs["base_url"] = base_url
    kwargs["default_headers"] = {**(kwargs.get("default_headers") or {}), **headers}
    if kwargs.get("api_key") is None and not os.environ.get(key_variable):
        kwargs["api_key"] = PLACEHOLDER_API_KEY
    return kwargs


def openai_client(base_url: str, headers: Mapping[str, str], **kwargs: Any) -> openai.OpenAI:
    """``openai.OpenAI`` with ``base_url`` and extra default headers; other kwargs pass through."""
    sdk = _require("openai", "openai")
    return sdk.OpenAI(**_sdk_kwargs(kwargs, base_url, headers, "OPENAI_API_KEY"))


def async_openai_client(base_url: str, headers: Mapping[str, str],
                        **kwargs: Any) -> openai.AsyncOpenAI:
    """``openai.AsyncOpenAI``, like :func:`openai_client`."""
    sdk = _require("openai", "openai")
    return sdk.AsyncOpenAI(**_sdk_kwargs(kwargs, base_url, headers, "OPENAI_API_KEY"))


def anthropic_client(base_url: str, headers: Mapping[str, str],
                     **kwargs: Any) -> anthropic.Anthropic:
    """``anthropic.Anthropic`` with ``base_url`` and extra default headers."""
    sdk = _require("anthropic", "anthropic")
    return sdk.Anthropic(**_sdk_kwargs(kwargs, base_url, headers, "ANTHROPIC_API_KEY"))


def async_anthropic_client(base_url: str, headers: Mapping[str, str],
                           **kwargs: Any) -> anthropic.AsyncAnthropic:
    """``anthropic.AsyncAnthropic``, like :func:`anthropic_client`."""
    sdk = _require("anthropic", "anthropic")
    return sdk.AsyncAnthropic(**_sdk_kwargs(kwargs, base_url, headers, "ANTHROPIC_API_KEY"))


def aiohttp_session(base_url: str, headers: Mapping[str, str],
                    **kwargs: Any) -> aiohttp.ClientSession:
    """``aiohttp.ClientSession`` whose relative URLs (``"charge"``, no leading slash) join
    ``base_url``; call it inside a running event loop and close it when done."""
    sdk = _require("aiohttp", "aiohttp")
    merged = {**(kwargs.pop("headers", None) or {}), **headers}
    return sdk.ClientSession(base_url=base_url.rstrip("/") + "/", headers=merged, **kwargs)
