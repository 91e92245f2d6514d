"""Secrets kept out of reprs and logs: a string that masks itself, and URLs shown masked."""

from __future__ import annotations

import dataclasses
import re
from urllib.parse import unquote, urlsplit


class Secret(str):
    """A string that never shows itself in a repr or a log line."""

    def __repr__(self) -> str:
        return "'***'"


# Query parameters shown as *** by a part of their name: secrets, and where to find them
# (libpq's password, sslpassword, passfile, sslkey; its options, which may carry
# `-c password=…`; api_key, access_token, client_secret, sig, …).
SECRET_PARAM = re.compile(r"(?i)pass|secret|token|key|auth|cred|sig|options")
QUERY_PARAM = re.compile(r"(^|[&;])([^=&;]*)=([^&;]*)")


def mask_url(url: str) -> str:
    """The URL with its password and every secret-looking query value replaced by ``***``."""
    try:
        parts = urlsplit(url)
    except ValueError:  # not a URL we can take apart: show none of it
        return "***"
    # Edited in place, not rebuilt: urlunsplit would drop the `//` of sqlite:///path.
    masked = url
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if at and ":" in userinfo:
        masked = masked.replace(parts.netloc, f"{userinfo.partition(':')[0]}:***@{hostport}", 1)
    if parts.query or parts.fragment:  # a fragment may carry one too (#access_token=…)
        before = masked.partition("?" if parts.query else "#")[0]
        query = f"?{QUERY_PARAM.sub(_mask_param, parts.query)}" if parts.query else ""
        fragment = f"#{QUERY_PARAM.sub(_mask_param, parts.fragment)}" if parts.fragment else ""
        masked = before + query + fragment
    return masked


def _mask_param(m: re.Match) -> str:
    name = m.group(2)
    return m.group(0) if not SECRET_PARAM.search(unquote(name)) else f"{m.group(1)}{name}=***"


def repr_masking_urls(self) -> str:
    """A dataclass's repr with its ``*url`` fields masked (a Secret masks itself)."""
    shown = (f"{f.name}={(mask_url(v) if f.name.endswith('url') and isinstance(v, str) else v)!r}"
             for f in dataclasses.fields(self) if f.repr for v in (getattr(self, f.name),))
    return f"{type(self).__name__}({', '.join(shown)})"
