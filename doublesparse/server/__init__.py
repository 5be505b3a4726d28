"""OpenAI-compatible HTTP server for the doublesparse engine.

Layout:
  config.py     frozen ``ServerConfig`` (host, port, api key, limits)
  protocol.py   request validation and OpenAI-style error bodies
  worker.py     the single engine thread and the queue that feeds it
  metrics.py    Prometheus collectors
  app.py        FastAPI routes (/v1/completions, /v1/chat/completions, /generate, ...)
  cli.py        ``doublesparse serve`` / ``python -m doublesparse.launch_server``
  fake_engine.py  a tiny deterministic engine implementing the Engine contract, and the real engine
                on a tiny random model (tests, dry runs)

Run:
  doublesparse serve --port 30000 [--api-key KEY] [--enable-double-sparsity --ds-heavy-token-num 256]
  python -m doublesparse.launch_server ...        (same flags)
  python -m doublesparse.bench_serving --base-url http://127.0.0.1:30000 --request-rate 8
"""

from doublesparse.server.config import ServerConfig

__all__ = ["ServerConfig"]
