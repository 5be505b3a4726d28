"""What the DS decode step must become for issue 5's output-tokens/s ratio to reach a target, from
a merged serving result (results/serving-h200.json). An estimate: the dense run and the prefill
stay as measured; only the DS run's full-concurrency decode steps (num_prompts // concurrency
cohorts of output_len - 1 steps each) get shorter.

    python benchmarks/serving_margin.py [results/serving-h200.json] [MORE.json ...] [--targets 1.40,1.42]

Also, per server, where the run's time goes under the cohort schedule (from the per-request
TTFTs and latencies): prefill ~ full cohorts x the median full-cohort TTFT + the last cohort's;
the decode step of the full cohorts and of the last, smaller one. With more than one file, each
run's ratio and their range and mean (the first file is the one analysed).
"""

from __future__ import annotations

import argparse
import json
import statistics


def cohorts(run):
    """(prefill_s, full_step_ms, last_step_ms or None) of one bench_serving run under the cohort
    schedule: its last num_prompts % concurrency requests (the shortest latencies) form the last cohort."""
    m, args = run["metrics"], run["args"]
    n_last = args["num_prompts"] % args["max_concurrency"]
    n_full = args["num_prompts"] // args["max_concurrency"]
    reqs = sorted((r[2], r[1]) for r in m["per_request"] if r[0])  # (latency, ttft), ok requests
    last, full = reqs[:n_last], reqs[n_last:]
    step = lambda rs: statistics.median((lat - ttft) / (args["output_len"] - 1) for lat, ttft in rs) * 1e3
    ttft = lambda rs: statistics.median(t for _, t in rs)
    prefill = n_full * ttft(full) + (ttft(last) if last else 0.0)
    return prefill, step(full), step(last) if last else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*", default=["results/serving-h200.json"])
    ap.add_argument("--targets", default="1.40,1.42")
    a = ap.parse_args(argv)
    runs = json.load(open(a.paths[0]))["runs"]
    dense, ds = runs["dense"]["metrics"]["duration_s"], runs["ds"]["metrics"]["duration_s"]
    args = runs["ds"]["args"]
    steps = args["num_prompts"] // args["max_concurrency"] * (args["output_len"] - 1)
    tpot = runs["ds"]["metrics"]["tpot_ms_p50"]
    print(f"dense {dense:.1f} s, DS {ds:.1f} s: ratio {dense / ds:.3f}; DS TPOT p50 {tpot:.2f} ms over "
          f"{steps} full-concurrency steps")
    for mode in ("dense", "ds"):
        prefill, full, last = cohorts(runs[mode])
        tail = f", last cohort {last:.2f} ms" if last is not None else ""
        print(f"{mode}: prefill ~{prefill:.1f} s; decode step {full:.2f} ms in full cohorts{tail}")
    print(f"each ms off the DS step: {dense / (ds - steps / 1000) - dense / ds:+.3f}")
    for t in (float(x) for x in a.targets.split(",")):
        cut_ms = (ds - dense / t) / steps * 1000
        how = (f"the DS step {cut_ms:.2f} ms shorter" if cut_ms > 0
               else f"met; the DS step could be {-cut_ms:.2f} ms longer")
        print(f"ratio {t:.2f}: {how} (TPOT p50 {tpot - cut_ms:.2f} ms)")
    if len(a.paths) > 1:
        ratios = [json.load(open(p))["summary"]["ds_over_dense_output_tok_s"] for p in a.paths]
        for p, r in zip(a.paths, ratios):
            print(f"  {p}: {r:.3f}")
        print(f"{len(ratios)} runs: {min(ratios):.3f}-{max(ratios):.3f}, mean {statistics.mean(ratios):.3f}")


if __name__ == "__main__":
    main()
