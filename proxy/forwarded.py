"""What the upstream is told about who sent a request (``X-Forwarded-For``, RFC 7239
``Forwarded``), as nginx's ``$proxy_add_x_forwarded_for`` tells it.

The real peer (the socket's address, never a header) is appended. What the request
claims about earlier hops is kept only when its peer is a trusted proxy
(``[server] trusted_proxies``); anyone else could write any address there, so from them
those claims are replaced: ``X-Forwarded-For`` and ``Forwarded`` name the peer alone,
and ``X-Forwarded-Host``, ``-Proto``, ``-Port`` and ``X-Real-IP`` are dropped.
``Forwarded`` is sent only when the request had one; ``X-Forwarded-For`` always.
"""

from __future__ import annotations

import ipaddress

from multidict import CIMultiDictProxy

# Every header that describes earlier hops: none passes on unchecked.
FORWARDING = frozenset({"x-forwarded-for", "forwarded", "x-forwarded-host", "x-forwarded-proto",
                        "x-forwarded-port", "x-real-ip"})
RELAYED = FORWARDING - {"x-forwarded-for", "forwarded"}  # passed on as they are, from a trusted proxy


class Forwarding:
    def __init__(self, trusted_proxies: tuple[str, ...]):
        self._trusted = tuple(ipaddress.ip_network(cidr, strict=False) for cidr in trusted_proxies)

    def headers(self, incoming: CIMultiDictProxy[str], peer: str | None) -> list[tuple[str, str]]:
        """The forwarding headers the upstream gets, in place of the request's own."""
        kept = bool(self._trusted) and self._trusts(_address(peer))  # most deployments trust none
        prior = ", ".join(incoming.getall("X-Forwarded-For", ())) if kept else ""
        out = [(name, value) for name, value in incoming.items()
               if name.lower() in RELAYED] if kept else []
        out.append(("X-Forwarded-For", f"{prior}, {peer or 'unknown'}" if prior else peer or "unknown"))
        if "Forwarded" in incoming:
            ours = "for=" + _node(_address(peer))
            earlier = ", ".join(incoming.getall("Forwarded")) if kept else ""
            out.append(("Forwarded", f"{earlier}, {ours}" if earlier else ours))
        return out

    def _trusts(self, address: ipaddress.IPv4Address | ipaddress.IPv6Address | None) -> bool:
        return address is not None and any(address in net for net in self._trusted)


def _address(peer: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(peer) if peer else None
    except ValueError:  # a Unix socket's peer has no address
        return None


def _node(address: ipaddress.IPv4Address | ipaddress.IPv6Address | None) -> str:
    """RFC 7239 §6: an IPv6 node is bracketed and quoted; no address is ``unknown``."""
    if address is None:
        return "unknown"
    return f'"[{address}]"' if address.version == 6 else str(address)
