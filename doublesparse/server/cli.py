"""``doublesparse serve`` / ``python -m doublesparse.launch_server``.

Engine flags come from ``doublesparse.config_flags`` (mirroring SGLang's names) when it is available;
server flags are ours. The port is bound and answers before the model has loaded (``/health``: 503
``loading``, server/loading.py). SIGTERM/SIGINT flip the app into draining mode: new requests get 503
"draining" and /health reports it while the accepted requests finish (at most
``--graceful-shutdown-timeout`` seconds, counted from the signal). At the deadline the requests
still running are cut: the engine drops them, each stream ends with an error event (code
``shutdown``) and ``[DONE]``, a waiting non-streamed request gets a 503. Then uvicorn stops
accepting connections (waiting at most a second for responses still being written) and runs the
lifespan shutdown that stops the engine thread. A second signal stops at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import sys
import threading
import time
from typing import Any, Callable

from doublesparse.cli_common import Parser, UsageError, run_main, with_flag_names
from doublesparse.server.config import ServerConfig

log = logging.getLogger("doublesparse.server")
DEFAULT_DRAIN_S = 300.0  # drain limit without --graceful-shutdown-timeout
CUT_GRACE_S = 0.5        # after the deadline: for cut streams' last events, then for uvicorn


def _engine_config_module():
    try:
        return importlib.import_module("doublesparse.config_flags")
    except ImportError:
        return None


def _fallback_engine_args(parser: argparse.ArgumentParser) -> None:
    """Minimal engine flags for when doublesparse.config_flags is not importable (e.g. fake engine)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model-path", default=None)
    g.add_argument("--max-total-tokens", type=int, default=None)
    g.add_argument("--enable-double-sparsity", action="store_true")
    g.add_argument("--ds-heavy-token-num", type=int, default=None)
    g.add_argument("--device", default=None)
    g.add_argument("--disable-cuda-graph", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="doublesparse serve", description="OpenAI-compatible server with Double Sparsity decoding")
    cfgmod = _engine_config_module()
    if cfgmod is not None and hasattr(cfgmod, "add_cli_args"):
        cfgmod.add_cli_args(p, enable_double_sparsity=True)
    else:
        _fallback_engine_args(p)
    ServerConfig.add_cli_args(p)
    # For tests and dry runs: "module:callable" building the engine from the engine kwargs.
    p.add_argument("--engine-factory", default=None, help=argparse.SUPPRESS)
    p.add_argument("--engine-kwargs", default=None, help=argparse.SUPPRESS)
    return p


def engine_kwargs(ns: argparse.Namespace) -> dict:
    cfgmod = _engine_config_module()
    if cfgmod is not None and hasattr(cfgmod, "from_cli_args"):
        from doublesparse.preflight import engine_config_from_cli

        # Double Sparsity on by default, as in ``generate``; --no-enable-double-sparsity turns it off
        ecfg = engine_config_from_cli(ns, enable_double_sparsity=True)
        if dataclasses.is_dataclass(ecfg):
            return {f.name: getattr(ecfg, f.name) for f in dataclasses.fields(ecfg)}
        return dict(ecfg)
    keys = ("model_path", "max_total_tokens", "enable_double_sparsity", "ds_heavy_token_num",
            "device", "disable_cuda_graph")
    return {k: getattr(ns, k) for k in keys if getattr(ns, k, None) is not None}


def build_engine(ns: argparse.Namespace) -> Any:
    kwargs = engine_kwargs(ns)
    if ns.engine_kwargs:
        import json
        kwargs.update(json.loads(ns.engine_kwargs))
    if ns.engine_factory:
        mod, _, attr = ns.engine_factory.partition(":")
        factory = getattr(importlib.import_module(mod), attr)
    else:
        from doublesparse.api import Engine as factory
    return factory(**kwargs)


def serve(build: Callable[[], Any], cfg: ServerConfig, sock=None) -> None:
    """Serve until stopped; ``build()`` makes the engine, on a thread of its own while the server
    already answers (``/health``: 503 ``loading``; see server/loading.py). ``sock``: the listening
    socket bound beforehand (else uvicorn binds ``cfg.host:cfg.port`` itself). A failed load stops
    the server and raises its error here."""
    import uvicorn

    from doublesparse.server.generation import SHUTDOWN
    from doublesparse.server.loading import LoadingApp

    port = sock.getsockname()[1] if sock is not None else cfg.port
    server: uvicorn.Server | None = None

    def ready(app) -> None:
        st = app.state.server
        # the snapshot is the engine's own stats, taken as the engine thread started: the line
        # says what /health and /metrics say
        log.info("serving %s on http://%s:%d; %s; %s", st.model_name, cfg.host, port,
                 kv_pool_line(st.worker.snapshot), decode_mode_line(st.worker.snapshot))

    def failed(_: BaseException) -> None:
        server.should_exit = True

    loading = LoadingApp(build, cfg, on_ready=ready, on_failure=failed)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            state = loading.state
            if state is None or state.draining:  # still loading, or a second signal: stop now
                super().handle_exit(sig, frame)
                return
            # Keep accepting connections while the accepted requests finish, so that new ones get
            # a 503 "draining" (and /health says so) instead of a refused connection; then stop.
            state.draining = True
            threading.Thread(target=self._drain_then_exit, args=(state, sig, frame), name="drain",
                             daemon=True).start()

        def _drain_then_exit(self, state, sig, frame):
            limit = cfg.graceful_shutdown_timeout
            deadline = time.monotonic() + (DEFAULT_DRAIN_S if limit is None else limit)
            while state.worker.in_flight > 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            if state.worker.in_flight > 0:  # the deadline: cut the rest, each with its last word
                log.warning("graceful shutdown: cutting %d requests still in flight",
                            state.worker.in_flight)
                state.worker.abort_all(SHUTDOWN)
                cut = time.monotonic() + CUT_GRACE_S
                while state.worker.in_flight > 0 and time.monotonic() < cut:
                    time.sleep(0.01)
            super().handle_exit(sig, frame)
            # uvicorn re-raises captured signals after shutdown (exit status -15); a completed
            # drain is a clean exit, so report 0 instead.
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

    # the drain above already waited; uvicorn only lets the last bytes go out
    ucfg = uvicorn.Config(loading, host=cfg.host, port=port, log_level=cfg.log_level,
                          timeout_graceful_shutdown=CUT_GRACE_S, lifespan="on",
                          timeout_keep_alive=5, access_log=False)
    log.info("loading the model; http://%s:%d/health answers 503 'loading' until it is ready",
             cfg.host, port)
    server = _Server(ucfg)
    server.run(sockets=[sock] if sock is not None else None)
    if loading.error is not None:
        raise loading.error


def kv_pool_line(stats: dict) -> str:
    """The KV pool's size in tokens and its dtype (an fp8 cache holds twice bf16's tokens)."""
    n = stats.get("kv_total_tokens")
    return f"KV pool {int(n) if isinstance(n, (int, float)) else '?'} tokens ({stats.get('kv_cache_dtype') or '?'})"


def decode_mode_line(stats: dict) -> str:
    """One line saying how decode runs: the mode, the budget and where the channels came from
    (from the engine's stats, as /health reports them)."""
    if "double_sparsity" not in stats:
        return "decode: mode not reported by the engine"
    if not stats["double_sparsity"]:
        return "decode: dense (Double Sparsity off)"
    op = stats.get("operating_point")
    return (f"decode: Double Sparsity, {stats.get('decode_policy')}; r={stats.get('heavy_channel_num')} "
            f"label channels from {stats.get('channel_source')}" + (f"; {op}" if op else ""))


def main(argv: list[str] | None = None) -> int:
    return run_main("doublesparse serve", _main, argv)


def _main(argv: list[str]) -> int:
    from doublesparse.preflight import bind_server_socket, check_engine_config

    from doublesparse.server.host_heap import fix_mmap_threshold

    ns = build_parser().parse_args(argv)
    try:
        cfg = ServerConfig.from_cli_args(ns)
    except ValueError as e:
        raise UsageError(with_flag_names(str(e), [f.name for f in dataclasses.fields(ServerConfig)])) from e
    kwargs = engine_kwargs(ns)  # validates the engine flags
    if not ns.engine_factory:
        from doublesparse.config import EngineConfig

        check_engine_config(EngineConfig(**kwargs))
    # the port is taken before the model loads: a busy one is reported at once, and the server
    # cannot fail to bind after it has announced its address
    sock = bind_server_socket(cfg.host, cfg.port)
    fix_mmap_threshold()  # the C heap stays flat under a long mixed load (server/host_heap.py)
    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serve(lambda: build_engine(ns), cfg, sock)
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
