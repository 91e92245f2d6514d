"""The proxy's own HTTP/1.1 client for upstreams: pool.py (keep-alive connections per origin and
tenant), connection.py (one connection, its answers framed by llhttp), egress.py (how an origin is
reached: egress proxy, TLS, happy eyeballs), errors.py (what a failure says the upstream saw),
wire.py (header values passed on as the bytes the upstream sent)."""
