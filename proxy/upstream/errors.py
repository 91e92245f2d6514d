"""What can go wrong in an exchange with an upstream, told by what the upstream can have seen:
``NotSent`` (no connection, so nothing was sent), ``UpstreamTimeout`` (silence longer than
``read_timeout``), any other ``UpstreamError`` (sent, outcome unknown)."""

from __future__ import annotations


class UpstreamError(Exception):
    """The exchange with an upstream failed; the request may have reached it."""


class NotSent(UpstreamError):
    """No connection to the upstream: it cannot have seen the request."""


class UpstreamTimeout(UpstreamError):
    """The upstream said nothing for longer than the configured timeout."""


class ConnectTimeout(NotSent, UpstreamTimeout):
    """No connection within ``connect_timeout``: a full listen backlog, or a pool whose
    connections all stayed busy."""


class UnsendableRequest(NotSent):
    """The request cannot be written as HTTP/1.1 (a line break in a header): nothing was sent."""


class HeadTooLarge(UpstreamError):
    """The upstream's answer head is over ``max_head_bytes`` or ``max_head_fields``."""
