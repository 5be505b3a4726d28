"""Benchmarks of the package (``python -m doublesparse.bench.<name>``)."""

import json


def emit_result(res: dict, path: str | None) -> None:
    """Write a bench's result ``res`` (JSON) to ``path`` if given, and print its ``summary``."""
    if path:
        with open(path, "w") as f:
            f.write(json.dumps(res, indent=1))
    print(json.dumps(res["summary"], indent=1))
