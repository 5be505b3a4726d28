"""``python -m doublesparse.bench_one_batch`` (SGLang's command name): doublesparse/bench/one_batch.py."""

from .bench.one_batch import main

if __name__ == "__main__":
    raise SystemExit(main())
