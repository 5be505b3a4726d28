"""Logits of doublesparse's loader + model against Hugging Face transformers on the same GGUF.

    python tools/compare_logits_hf.py --model-path qwen2.5-coder-1.5b [--output out.json]
        [--dtype float32] [--max-tokens 96] [--device cpu] [--max-abs 0.05] [--max-mean 0.005]

transformers dequantizes the GGUF with gguf's numpy reference and runs its own Qwen2/Llama code;
we dequantize with our torch kernels and run ours. Each side runs in its own process, one model in
memory at a time (the 1.5B model in float32 needs about 7 GB for ours and up to about 13 GB while
transformers loads), and saves its logits; the parent compares them over a few prompts
(chat-formatted code question, prose, code) and prints / writes max and mean |difference|,
top-1 agreement and KL(transformers || ours). Exits non-zero if a bound is exceeded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    (
        "chat",
        [
            {
                "role": "user",
                "content": "Write a Python function that merges two sorted lists into one "
                "sorted list in linear time, with a docstring and two tests.",
            }
        ],
    ),
    (
        "prose",
        (
            "When shall we three meet again in thunder, lightning, or in rain? When the hurlyburly's "
            "done, when the battle's lost and won. That will be ere the set of sun. Where the place? "
            "Upon the heath. There to meet with Macbeth."
        ),
    ),
    (
        "code",
        (
            "import numpy as np\n\n\ndef softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:\n"
            '    """Numerically stable softmax."""\n    z = x - x.max(axis=axis, keepdims=True)\n'
        ),
    ),
]


def _token_ids(tok, max_tokens: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in PROMPTS:
        if isinstance(p, list):
            ids = tok.apply_chat_template(
                p, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        else:
            ids = tok.encode(p)
        out[name] = torch.tensor(list(ids)[:max_tokens])
    return out


def run_side(side: str, args, save: Path) -> None:
    """Load one model, run every prompt, save {name: logits [T, vocab] float32} and timings."""
    sys.path.insert(0, str(ROOT))
    from doublesparse.models import forward_sequence, load_model, load_tokenizer
    from doublesparse.models.loader import resolve_model_path

    dtype = getattr(torch, args.dtype)
    _, path = resolve_model_path(args.model_path)
    ids = _token_ids(load_tokenizer(args.model_path), args.max_tokens)
    t0 = time.time()
    if side == "ours":
        model = load_model(
            args.model_path, dtype=dtype, device=args.device, progress=False
        )
        run = lambda x: forward_sequence(model, x)
    else:
        import transformers

        model = (
            transformers.AutoModelForCausalLM.from_pretrained(
                str(path.parent),
                gguf_file=path.name,
                dtype=dtype,
                local_files_only=True,
            )
            .to(args.device)
            .eval()
        )
        run = lambda x: model(x[None].to(args.device)).logits[0]
    load_s = time.time() - t0
    with torch.inference_mode():
        logits = {name: run(x).float().cpu() for name, x in ids.items()}
    torch.save({"logits": logits, "ids": ids, "load_s": load_s}, save)


def compare(a: dict, b: dict) -> dict:
    """Per prompt and overall: |ours - hf| max/mean, top-1 agreement, KL(hf || ours)."""
    rows, worst, means, agree, kls, n = {}, 0.0, [], 0, [], 0
    for name in b["logits"]:
        x, y = a["logits"][name], b["logits"][name]
        d = (x - y).abs()
        kl = torch.nn.functional.kl_div(
            x.log_softmax(-1), y.log_softmax(-1), log_target=True, reduction="none"
        ).sum(-1)
        same = (x.argmax(-1) == y.argmax(-1)).sum().item()
        rows[name] = {
            "tokens": len(x),
            "max_abs_diff": d.max().item(),
            "mean_abs_diff": d.mean().item(),
            "max_abs_logit": y.abs().max().item(),
            "top1_agreement": same / len(x),
            "kl_mean": kl.mean().item(),
            "kl_max": kl.max().item(),
        }
        worst, n, agree = max(worst, d.max().item()), n + len(x), agree + same
        means.append(d.mean().item())
        kls.append(kl)
    return {
        "prompts": rows,
        "max_abs_diff": worst,
        "mean_abs_diff": sum(means) / len(means),
        "top1_agreement": agree / n,
        "kl_mean": torch.cat(kls).mean().item(),
        "load_s": {"ours": a["load_s"], "transformers": b["load_s"]},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default="qwen2.5-coder-1.5b")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--max-tokens", type=int, default=96, help="tokens per prompt (truncated)"
    )
    p.add_argument(
        "--max-abs", type=float, default=0.05, help="bound on max |logit difference|"
    )
    p.add_argument(
        "--max-mean", type=float, default=0.005, help="bound on mean |logit difference|"
    )
    p.add_argument("--output", default=None, help="write the comparison as JSON here")
    p.add_argument("--side", choices=["ours", "hf"], help=argparse.SUPPRESS)
    p.add_argument("--save", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.side:
        run_side(args.side, args, Path(args.save))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        saved = {}
        for side in ("hf", "ours"):
            saved[side] = Path(tmp) / f"{side}.pt"
            cmd = [
                sys.executable,
                __file__,
                "--side",
                side,
                "--save",
                str(saved[side]),
                "--model-path",
                args.model_path,
                "--dtype",
                args.dtype,
                "--device",
                args.device,
                "--max-tokens",
                str(args.max_tokens),
            ]
            subprocess.run(cmd, check=True, env=os.environ | {"HF_HUB_OFFLINE": "1"})
        res = compare(torch.load(saved["ours"]), torch.load(saved["hf"]))
    res.update(
        model_path=args.model_path,
        dtype=args.dtype,
        device=args.device,
        bounds={"max_abs_diff": args.max_abs, "mean_abs_diff": args.max_mean},
    )
    print(json.dumps(res, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(res, indent=1) + "\n")
    ok = res["max_abs_diff"] <= args.max_abs and res["mean_abs_diff"] <= args.max_mean
    print("OK" if ok else "FAIL: a bound is exceeded", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
