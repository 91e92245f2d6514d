"""What the proxy tells about itself: metrics.py (Prometheus: outcomes, latency, what replays
saved), pricing.py (a model call's cost), facts.py (one call's facts, gathered as it goes, for
its log line and span), access_log.py (one line per request), tracing.py (whether calls are
traced, from OTEL_* variables) and otel.py (the spans, imported only when tracing is on)."""
