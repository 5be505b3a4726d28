"""Accuracy of CPU decode through the packed weight copies (models/packed.py) against the float32
weights, on the eval text, for dense decode and the engine's default Double Sparsity setting.

    python benchmarks/cpu_packed_accuracy.py --output FILE.json [--window-len 2048]
        [--decode-len 256] [--num-windows 8]

The windows are prefilled with the float weights (as the engine prefills), then their last
``--decode-len`` tokens are decoded teacher-forced through ``doublesparse.eval``'s decode path
twice: with the float32 weights and with the packed copies (a decode forward multiplies by them
whatever its row count; a row's result does not depend on how many rows share the forward). Reports per setting:
perplexity of each and their relative difference, mean KL(float || packed) in nats, top-1
agreement, and the largest logit difference.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch


def table(doc: dict) -> list[str]:
    """Markdown lines of the per-setting figures."""
    out = [f"Packed vs float32 decode weights: {doc['num_windows']} windows of {doc['window_len']} tokens of the "
           f"eval text, the last {doc['decode_len']} decoded teacher-forced.", "",
           "| setting | tokens | ppl float32 | ppl packed | diff | KL(float32 || packed) | top-1 agree | max abs logit diff |",
           "|---|---|---|---|---|---|---|---|"]
    for name, r in doc["settings"].items():
        out.append(f"| {name} | {r['tokens']} | {r['ppl_float']:.3f} | {r['ppl_packed']:.3f} | "
                   f"{100 * r['ppl_rel_diff']:+.2f} % | {r['kl_float_packed']:.2e} | {r['top1_agree']:.4f} | "
                   f"{r['max_abs_logit_diff']:.3f} |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True)
    p.add_argument("--window-len", type=int, default=2048)
    p.add_argument("--decode-len", type=int, default=256)
    p.add_argument("--num-windows", type=int, default=8)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (one: two threads of a shared 2-core machine wait on each other)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)

    from doublesparse.eval import driver, measure
    from doublesparse.eval.cli import build_parser, channel_source, eval_windows, model_point, recorded_layer_modes
    from doublesparse.eval.settings import DENSE, default_setting
    from doublesparse.models import load_model, load_tokenizer
    from doublesparse.models.layers import Linear

    model = load_model(None, progress=False, packed=True)
    tok = load_tokenizer(None)
    args = build_parser().parse_args(["--small"])
    c = model.config
    windows = eval_windows(args, tok, a.window_len, a.num_windows)
    channels_for, _ = channel_source(args, model)
    settings = [DENSE, default_setting(int(c.head_dim), int(c.max_position_embeddings),
                                       recorded_layer_modes(args, model), point=model_point(args, model))]
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.packed is not None]
    copies = [m.packed for m in linears]

    def use(packed: bool):
        for m, cp in zip(linears, copies):
            m.packed = cp if packed else None

    use(False)  # prefill with the float weights, as the engine does
    runner = measure.TextRunner(model, windows, a.decode_len, channels_for, "cpu", 0)
    out = {"window_len": a.window_len, "decode_len": a.decode_len, "num_windows": len(windows),
           "packed_kinds": sorted({cp.kind for cp in copies}), "settings": {}}
    with torch.inference_mode():
        for s in settings:
            ch = channels_for(s) if s.kind == "ds" else None
            acc = {"nll_float": 0.0, "nll_packed": 0.0, "kl": 0.0, "top1": 0.0, "max_dlogit": 0.0, "n": 0}
            for pools, inputs, targets, _ in runner.groups:
                if ch is not None:
                    pools.relabel(ch, s.label)
                logits = {}
                for packed in (False, True):
                    use(packed)
                    logits[packed] = driver.decode_tokens(model, pools, s, ch, inputs, s.k_for(runner.wl))
                lf, lp = logits[False].log_softmax(-1), logits[True].log_softmax(-1)
                acc["nll_float"] += float(-lf.gather(1, targets[:, None]).sum())
                acc["nll_packed"] += float(-lp.gather(1, targets[:, None]).sum())
                acc["kl"] += float((lf.exp() * (lf - lp)).sum())
                acc["top1"] += float((lf.argmax(-1) == lp.argmax(-1)).sum())
                acc["max_dlogit"] = max(acc["max_dlogit"], float((logits[False] - logits[True]).abs().max()))
                acc["n"] += targets.numel()
            n = acc["n"]
            pf, pp = math.exp(acc["nll_float"] / n), math.exp(acc["nll_packed"] / n)
            out["settings"][s.name] = {"tokens": n, "ppl_float": pf, "ppl_packed": pp, "ppl_rel_diff": pp / pf - 1,
                                       "kl_float_packed": acc["kl"] / n, "top1_agree": acc["top1"] / n,
                                       "max_abs_logit_diff": acc["max_dlogit"]}
    use(True)
    out["table_md"] = "\n".join(table(out))
    with open(a.output, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
