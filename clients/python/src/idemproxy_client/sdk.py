"""Ready clients of popular SDKs, pointed at the proxy's run-scoped base URL.

The SDKs are optional extras (``idemproxy-client[openai]``, ``[anthropic]``,
``[aiohttp]``) and imported only when asked for.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Mapping

if TYPE_CHECKING:
    from aiohttp import ClientSession
    from anthropic import Anthropic, AsyncAnthropic
    from openai import AsyncOpenAI, OpenAI

# Sent when the agent holds no key because the proxy injects the real credential
# (an upstream's ``set_headers``): the SDKs refuse to start without one.
PLACEHOLDER_API_KEY = "idemproxy-injected"


@contextmanager
def _extra(extra: str) -> Iterator[None]:
    """Turn a missing optional SDK into an error that says which extra installs it."""
    try:
        yield
    except ImportError as exc:
        raise ImportError(f"{exc.name or extra} is not installed: "
                          f"pip install 'idemproxy-client[{extra}]'") from exc


def _sdk_kwargs(kwargs: dict[str, Any], base_url: str, headers: Mapping[str, str],
                key_variable: str) -> dict[str, Any]:
    kwargs = dict(kwargs)
    kwargs["base_url"] = base_url
    kwargs["default_headers"] = {**(kwargs.get("default_headers") or {}), **headers}
    if kwargs.get("api_key") is None and not os.environ.get(key_variable):
        kwargs["api_key"] = PLACEHOLDER_API_KEY
    return kwargs


def openai_client(base_url: str, headers: Mapping[str, str], **kwargs: Any) -> OpenAI:
    """``openai.OpenAI`` with ``base_url`` and extra default headers; other kwargs pass through."""
    with _extra("openai"):
        from openai import OpenAI
    return OpenAI(**_sdk_kwargs(kwargs, base_url, headers, "OPENAI_API_KEY"))


def async_openai_client(base_url: str, headers: Mapping[str, str], **kwargs: Any) -> AsyncOpenAI:
    """``openai.AsyncOpenAI``, like :func:`openai_client`."""
    with _extra("openai"):
        from openai import AsyncOpenAI
    return AsyncOpenAI(**_sdk_kwargs(kwargs, base_url, headers, "OPENAI_API_KEY"))


def anthropic_client(base_url: str, headers: Mapping[str, str], **kwargs: Any) -> Anthropic:
    """``anthropic.Anthropic`` with ``base_url`` and extra default headers."""
    with _extra("anthropic"):
        from anthropic import Anthropic
    return Anthropic(**_sdk_kwargs(kwargs, base_url, headers, "ANTHROPIC_API_KEY"))


def async_anthropic_client(base_url: str, headers: Mapping[str, str],
                           **kwargs: Any) -> AsyncAnthropic:
    """``anthropic.AsyncAnthropic``, like :func:`anthropic_client`."""
    with _extra("anthropic"):
        from anthropic import AsyncAnthropic
    return AsyncAnthropic(**_sdk_kwargs(kwargs, base_url, headers, "ANTHROPIC_API_KEY"))


def aiohttp_session(base_url: str, headers: Mapping[str, str], **kwargs: Any) -> ClientSession:
    """``aiohttp.ClientSession`` whose relative URLs (``"charge"``, no leading slash) join
    ``base_url``; call it inside a running event loop and close it when done."""
    with _extra("aiohttp"):
        from aiohttp import ClientSession
    merged = {**(kwargs.pop("headers", None) or {}), **headers}
    return ClientSession(base_url=base_url.rstrip("/") + "/", headers=merged, **kwargs)
