"""What an fp8 K/V cache costs Double Sparsity, split in two: the attention over the selected
tokens reading fp8 K/V, and the selection changing. On the embedded SmolLM2 and the windows of

    doublesparse eval --default-only --no-retrieval --no-fidelity --window-len W --decode-len 256
        --num-windows 4 --kv-cache-dtypes auto fp8_e4m3

(the engine's default setting over the model's cache and over fp8 e4m3 with the default q/K
rotation), on the PyTorch path, it scores: dense, DS, DS over fp8 attending to the tokens DS over
the model's cache selected (its selections recorded token by token and layer by layer, then
replayed: the teacher-forced decode makes the same calls in the same order), DS over fp8 with its
own selection, and dense over fp8; and the share of the fp8 run's selected tokens that DS over the
model's cache selected too.

    python benchmarks/fp8_ds_split.py --window-len 4096 --output FILE.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

import torch


@contextlib.contextmanager
def selections(record: list | None = None, replay: list | None = None, overlap: list | None = None):
    """Within: ``torch_ops.select`` (the PyTorch path's per-request selection) appends its results
    to ``record``, or returns those of ``replay`` in order, adding to ``overlap`` [hits, entries]
    how many of its own selected slots the replayed rows hold."""
    from doublesparse.kernels import torch_ops
    orig = torch_ops.select
    it = iter(replay or ())

    def patched(*a, **kw):
        own = orig(*a, **kw)
        if replay is None:
            record.append(own)
            return own
        sel, valid = next(it)
        overlap[0] += sum(int(torch.isin(own[0][i], sel[i]).sum()) for i in range(sel.shape[0]))
        overlap[1] += sel.numel()
        return sel, valid

    torch_ops.select = patched
    try:
        yield
    finally:
        torch_ops.select = orig
    if replay is not None and next(it, None) is not None:
        raise RuntimeError("the replayed run made fewer selections than the recorded one")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True)
    p.add_argument("--window-len", type=int, default=4096)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from doublesparse.eval import cli, measure

    t0 = time.time()
    args = cli.build_parser().parse_args(
        ["-o", "unused", "--default-only", "--no-retrieval", "--no-fidelity", "--window-len", str(a.window_len),
         "--decode-len", "256", "--num-windows", "4", "--kv-cache-dtypes", "auto", "fp8_e4m3", "--quiet"])
    model, tok = cli.load_model_for_eval(args)
    c = model.config
    dense, ds, dense8, ds8 = cli.settings_for(args, int(c.head_dim), int(c.max_position_embeddings),
                                              cli.recorded_layer_modes(args, model),
                                              bool(getattr(c, "attention_bias", False)), cli.model_point(args, model))
    channels_for, _ = cli.channel_source(args, model)
    runner = measure.TextRunner(model, cli.eval_windows(args, tok, a.window_len, 4), 256, channels_for)
    doc = {"window_len": a.window_len, "setting": ds.name, "rows": {}}

    def score(name, s):
        r = runner.run(s)
        doc["rows"][name] = {"ppl": r.ppl, "kl": r.kl, "top1": r.top1, "tokens": r.tokens}
        print(name, doc["rows"][name], f"{time.time() - t0:.0f} s", file=sys.stderr, flush=True)

    score("dense", dense)
    rec: list = []
    with selections(record=rec):
        score("ds", ds)
    hits = [0, 0]
    with selections(replay=rec, overlap=hits):
        score("ds_fp8_selection_of_ds", ds8)
    doc["selection_overlap"] = hits[0] / max(1, hits[1])
    score("ds_fp8", ds8)
    score("dense_fp8", dense8)
    from run import git_commit, machine_name  # benchmarks/run.py, beside this script
    doc.update(seconds=round(time.time() - t0, 1),
               command="python benchmarks/fp8_ds_split.py " + " ".join(sys.argv[1:] if argv is None else argv),
               commit=git_commit(), machine=machine_name(), date=time.strftime("%Y-%m-%d"))
    with open(a.output, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
