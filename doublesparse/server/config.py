"""Server-side configuration (everything that is not an engine flag)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class ServerConfig:
    """Settings of the HTTP layer. Frozen: built once from the CLI and shared read-only."""

    host: str = "127.0.0.1"
    port: int = 30000
    # When set, every /v1/*, /generate and /metrics request needs ``Authorization: Bearer <key>``.
    api_key: str | None = None
    # Name reported by /v1/models and accepted in the ``model`` field; None -> derived from the engine.
    served_model_name: str | None = None
    # Bodies above this are refused with 413 before JSON parsing, so a huge upload cannot eat memory.
    max_body_bytes: int = 8 * 1024 * 1024
    # Upper bound for max_tokens on top of the context-window check (None: only the context bounds).
    max_new_tokens_limit: int | None = None
    # Default max_tokens of /v1/completions when the client sends none (OpenAI's default is 16).
    default_completion_tokens: int = 16
    # Seconds to let in-flight requests finish after SIGTERM; at the deadline the rest are cut
    # (streams end with an error event and [DONE]) and the server exits (None: up to 300 s).
    graceful_shutdown_timeout: float | None = None
    # Engine requests one OpenAI request may fan out into: prompts x max(n, best_of) (None: no
    # bound beyond 128 prompts and n, best_of <= 128).
    max_choices_per_request: int | None = 1024
    # Engine requests one client (peer address) may have accepted and unfinished; past it, 429
    # (None: no bound).
    max_requests_per_client: int | None = 4096
    log_level: str = "info"

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        for name in ("max_body_bytes", "default_completion_tokens", "max_new_tokens_limit",
                     "max_choices_per_request", "max_requests_per_client"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        t = self.graceful_shutdown_timeout
        if t is not None and not (math.isfinite(t) and t >= 0):
            raise ValueError(f"graceful_shutdown_timeout must be a finite number of seconds >= 0, got {t}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("server")
        g.add_argument("--host", default=ServerConfig.host, help="address to listen on")
        g.add_argument("--port", type=int, default=ServerConfig.port, help="TCP port to listen on")
        g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
        g.add_argument("--served-model-name", default=None, help="model name exposed by the API")
        g.add_argument("--max-body-bytes", type=int, default=ServerConfig.max_body_bytes,
                       help="largest accepted request body in bytes")
        g.add_argument("--max-new-tokens-limit", type=int, default=None,
                       help="refuse requests asking for more new tokens than this")
        g.add_argument("--default-completion-tokens", type=int,
                       default=ServerConfig.default_completion_tokens,
                       help="max_tokens of /v1/completions requests that give none")
        g.add_argument("--graceful-shutdown-timeout", type=float, default=None,
                       help="seconds to let in-flight requests finish after SIGTERM; then the rest "
                            "are cut (streams get an error event and [DONE]) and the server exits "
                            "(default: 300)")
        g.add_argument("--max-choices-per-request", type=_limit,
                       default=ServerConfig.max_choices_per_request,
                       help="most samples one request may ask for: prompts x max(n, best_of); "
                            "past it, 400 (0: no bound; default %(default)s)")
        g.add_argument("--max-requests-per-client", type=_limit,
                       default=ServerConfig.max_requests_per_client,
                       help="most samples one client address may have queued or running; past "
                            "it, 429 (0: no bound; default %(default)s)")
        g.add_argument("--log-level", default=ServerConfig.log_level, type=str.lower, choices=LOG_LEVELS)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "ServerConfig":
        return cls(
            host=ns.host, port=ns.port, api_key=ns.api_key, served_model_name=ns.served_model_name,
            max_body_bytes=ns.max_body_bytes, max_new_tokens_limit=ns.max_new_tokens_limit,
            default_completion_tokens=ns.default_completion_tokens,
            graceful_shutdown_timeout=ns.graceful_shutdown_timeout, log_level=ns.log_level,
            max_choices_per_request=ns.max_choices_per_request,
            max_requests_per_client=ns.max_requests_per_client,
        )


def _limit(text: str) -> int | None:
    """A count flag where 0 means no bound."""
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0: no bound), got {v}")
    return v or None
