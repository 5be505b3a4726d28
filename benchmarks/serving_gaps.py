"""Stalls inside requests of a bench_serving run: each request's largest gap between tokens.

    python benchmarks/serving_gaps.py RESULT.json [RESULT.json ...] [--min-gap 1.0]

Reads ``metrics.per_request`` ([ok, ttft_s, latency_s, output_tokens, max_itl_s]) of
``bench_serving --result-json`` files; prints the largest gap of any request and the requests
whose largest gap exceeds ``--min-gap`` seconds, with their time to first token.
"""

from __future__ import annotations

import argparse
import json


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+")
    ap.add_argument("--min-gap", type=float, default=1.0)
    args = ap.parse_args(argv)
    for path in args.results:
        rows = [r for r in json.load(open(path))["metrics"]["per_request"] if r[4] is not None]
        worst = max(r[4] for r in rows)
        stalled = sorted((r for r in rows if r[4] > args.min_gap), key=lambda r: r[1])
        print(f"{path}: {len(rows)} requests, largest gap between tokens {worst:.3f} s; "
              f"{len(stalled)} with a gap above {args.min_gap} s")
        for r in stalled:
            print(f"  TTFT {r[1]:.3f} s, largest gap {r[4]:.3f} s, latency {r[2]:.3f} s")


if __name__ == "__main__":
    main()
