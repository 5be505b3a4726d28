"""``python -m doublesparse.bench_serving`` (SGLang's command name): doublesparse/bench/serving.py."""

from .bench.serving import main

if __name__ == "__main__":
    raise SystemExit(main())
