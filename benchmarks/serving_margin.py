"""What the DS decode step must become for issue 5's output-tokens/s ratio to reach a target, from
a merged serving result (results/serving-h200.json). An estimate: the dense run and the prefill
stay as measured; only the DS run's full-concurrency decode steps (num_prompts // concurrency
cohorts of output_len - 1 steps each) get shorter.

    python benchmarks/serving_margin.py [results/serving-h200.json] [--targets 1.40,1.42]
"""

from __future__ import annotations

import argparse
import json


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", nargs="?", default="results/serving-h200.json")
    ap.add_argument("--targets", default="1.40,1.42")
    a = ap.parse_args(argv)
    runs = json.load(open(a.path))["runs"]
    dense, ds = runs["dense"]["metrics"]["duration_s"], runs["ds"]["metrics"]["duration_s"]
    args = runs["ds"]["args"]
    steps = args["num_prompts"] // args["max_concurrency"] * (args["output_len"] - 1)
    tpot = runs["ds"]["metrics"]["tpot_ms_p50"]
    print(f"dense {dense:.1f} s, DS {ds:.1f} s: ratio {dense / ds:.3f}; DS TPOT p50 {tpot:.2f} ms over "
          f"{steps} full-concurrency steps")
    print(f"each ms off the DS step: {dense / (ds - steps / 1000) - dense / ds:+.3f}")
    for t in (float(x) for x in a.targets.split(",")):
        cut_ms = (ds - dense / t) / steps * 1000
        how = (f"the DS step {cut_ms:.2f} ms shorter" if cut_ms > 0
               else f"met; the DS step could be {-cut_ms:.2f} ms longer")
        print(f"ratio {t:.2f}: {how} (TPOT p50 {tpot - cut_ms:.2f} ms)")


if __name__ == "__main__":
    main()
