"""Probe (the PyTorch decode path, CPU is enough): how far a decode step's top-k threshold moves from
the step before, per layer and score row. Would a select that starts from the previous step's
threshold (filter the scores against it inside the score kernel, then resolve the exact top-k
among the few candidates) hold, and how many candidates would it carry?

    python benchmarks/threshold_drift.py [--play macbeth_gut] [--prompt-tokens 4000] [--steps 48]
                                         [--k 256] [--json OUT.json]

Runs the embedded SmolLM2-135M (``doublesparse.Engine``, double sparsity, greedy) on the opening of
a play and records, at every decode step, every layer's approximate scores (``torch_ops.
label_scores``, the engine's selection mode and channels). For each (step t > first, layer, score
row) and each f: T = the (f * k)-th largest score of step t - 1; candidates = the positions whose
step-t score is >= T, plus the new position. The speculation holds when there are >= k candidates
(the exact top-k then lies among them); its cost is candidates / k. Per f: the fraction of rows
where it holds, and the median and 90th percentile of candidates / k. Labels of cached tokens do
not change between steps; only the query does.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from doublesparse import Engine
from doublesparse.assets import read_play
from doublesparse.engine.sampling_params import SamplingParams
from doublesparse.kernels import torch_ops

FACTORS = (1.0, 1.25, 1.5, 2.0)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--play", default="macbeth_gut")
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--k", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    eng = Engine(enable_double_sparsity=True, ds_heavy_token_num=args.k, device="cpu", progress=False)
    layers = eng.model_config.num_layers
    ids = eng.tokenizer.encode(read_play(args.play), add_special_tokens=False)[: args.prompt_tokens]
    calls = []  # per ds_decode call (one per layer and step): the scores [R, L] of request 0
    orig = torch_ops.ds_decode

    def recording(q, k_cache, v_cache, label_cache, label_scale, channels, req_to_token, req_idx, seq_lens,
                  sm_scale, heavy_token_num, mode="group_max", *rest, **kw):
        L = int(seq_lens[0])
        s, _ = torch_ops.label_scores(q[:1], label_cache, label_scale, channels, req_to_token, req_idx[:1], L,
                                      sm_scale, mode)
        calls.append(s[0].clone())
        return orig(q, k_cache, v_cache, label_cache, label_scale, channels, req_to_token, req_idx, seq_lens,
                    sm_scale, heavy_token_num, mode, *rest, **kw)

    torch_ops.ds_decode = recording
    try:
        out = eng.generate([ids], SamplingParams(max_new_tokens=args.steps + 1, temperature=0, ignore_eos=True))
    finally:
        torch_ops.ds_decode = orig
    steps = len(calls) // layers
    k = args.k
    held = {f: [] for f in FACTORS}
    ratio = {f: [] for f in FACTORS}
    for t in range(1, steps):
        for layer in range(layers):
            prev, cur = calls[(t - 1) * layers + layer], calls[t * layers + layer]
            n_prev = prev.shape[1]
            for f in FACTORS:
                m = min(int(f * k), n_prev)
                thr = prev.topk(m, dim=1).values[:, -1:]                     # [R, 1]
                count = (cur[:, :n_prev] >= thr).sum(1) + (cur.shape[1] - n_prev)
                held[f] += (count >= k).tolist()
                ratio[f] += (count.float() / k).tolist()
    rows = []
    print(f"SmolLM2-135M, {args.play} {len(ids)} prompt tokens, {steps} decode steps x {layers} layers, "
          f"k {k}, {calls[0].shape[0]} score rows per layer")
    for f in FACTORS:
        r = sorted(ratio[f])
        row = dict(factor=f, holds=sum(held[f]) / len(held[f]), median_candidates_over_k=statistics.median(r),
                   p90_candidates_over_k=r[int(0.9 * (len(r) - 1))], rows=len(r))
        rows.append(row)
        print(f"  threshold at rank {f:.2f} k of the step before: holds {row['holds']:.3f}, candidates / k "
              f"median {row['median_candidates_over_k']:.2f}, p90 {row['p90_candidates_over_k']:.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(command="python benchmarks/threshold_drift.py " + " ".join(argv or []), args=vars(args),
                           prompt_tokens=len(ids), decode_steps=steps, completion=out[0]["text"][:200],
                           rows=rows), fh, indent=1)


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
