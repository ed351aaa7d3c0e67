"""The OpenAI-compatible HTTP server: `tiered serve` (app.py), its engine thread (engine.py),
request bodies (protocol.py) and Prometheus metrics (metrics.py)."""
