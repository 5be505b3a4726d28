"""Summarize bench_one_batch result files (``--result-json``) into a markdown table and a JSON summary.

    python -m doublesparse.bench.report_one_batch DIR --md OUT.md --json OUT.json --device "..."
        [--commands DIR/commands.json] [--note TEXT]

DIR holds the files under these names (the commands that made them are written into the report):
llama31-8b-60k-bs3-{dense,ds-r16-k3750,ds-r32-k3000}.json, longchat-7b-20k-bs3-{dense,ds-r16-k1024}.json,
smollm2-8k-bs1-{dense,ds}.json. Each case's command is the one its result file recorded, else CASES's;
``--commands`` names a JSON {case: command} that overrides both (for older result files). Runs made with ``--profile`` also get their GPU-only step time and launch count.
"""

from __future__ import annotations

import argparse
import json
import os
import time

BASE = "python -m doublesparse.bench_one_batch --load-format dummy --batch-size 3 --output-len 200"
CASES = {
    "llama31-8b-60k-bs3-dense": f"{BASE} --model-path llama-3.1-8b --input-len 60000 --max-total-tokens 190000",
    "llama31-8b-60k-bs3-ds-r16-k3750": f"{BASE} --model-path llama-3.1-8b --input-len 60000 --max-total-tokens 190000 "
                                       "--enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 3750",
    "llama31-8b-60k-bs3-ds-r32-k3000": f"{BASE} --model-path llama-3.1-8b --input-len 60000 --max-total-tokens 190000 "
                                       "--enable-double-sparsity --ds-heavy-channel-num 32 --ds-heavy-token-num 3000",
    "longchat-7b-20k-bs3-dense": f"{BASE} --model-path longchat-7b-v1.5-32k --input-len 20000 --max-total-tokens 70000",
    "longchat-7b-20k-bs3-ds-r16-k1024": f"{BASE} --model-path longchat-7b-v1.5-32k --input-len 20000 --max-total-tokens 70000 "
                                        "--enable-double-sparsity --ds-heavy-channel-num 16 --ds-heavy-token-num 1024",
    "smollm2-8k-bs1-dense": "python -m doublesparse.bench_one_batch --model-path smollm2.gguf --batch-size 1 "
                            "--input-len 8000 --output-len 128",
    "smollm2-8k-bs1-ds": "python -m doublesparse.bench_one_batch --model-path smollm2.gguf --batch-size 1 "
                         "--input-len 8000 --output-len 128 --enable-double-sparsity",
}


def load(d, name):
    with open(os.path.join(d, name + ".json")) as f:
        data = json.load(f)
    return data, data["results"][0]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--md", required=True)
    ap.add_argument("--json", required=True)
    ap.add_argument("--device", required=True)
    ap.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    ap.add_argument("--commands", help="JSON {case: command}, for runs made with other flags than CASES's")
    ap.add_argument("--note", default="", help="a paragraph for the top of the markdown")
    a = ap.parse_args(argv)
    runs = {n: load(a.dir, n) for n in CASES}
    # the command a run recorded itself (bench_one_batch --result-json), else CASES's; --commands wins
    commands = {n: runs[n][0].get("command", c) for n, c in CASES.items()}
    if a.commands:
        with open(a.commands) as f:
            commands.update(json.load(f))
    dense_meta, dense = runs["llama31-8b-60k-bs3-dense"]
    bw = dense_meta["copy_bandwidth"]
    floor = dense["median_step_bytes"] / bw
    med = lambda n: runs[n][1]["median_decode_latency"]
    summary = {
        "dense_decode_over_floor": dense["median_decode_latency"] / floor,
        "ds_decode_speedup": med("llama31-8b-60k-bs3-dense") / med("llama31-8b-60k-bs3-ds-r16-k3750"),
        "ds_decode_speedup_seed_setting": med("llama31-8b-60k-bs3-dense") / med("llama31-8b-60k-bs3-ds-r32-k3000"),
        "prefill_ds_over_dense": runs["llama31-8b-60k-bs3-ds-r16-k3750"][1]["prefill_throughput"] / dense["prefill_throughput"],
        "longchat_ds_decode_speedup": med("longchat-7b-20k-bs3-dense") / med("longchat-7b-20k-bs3-ds-r16-k1024"),
        "smollm2_bs1_decode_tok_s": max(runs["smollm2-8k-bs1-dense"][1]["median_decode_throughput"],
                                        runs["smollm2-8k-bs1-ds"][1]["median_decode_throughput"]),
        "commands": list(commands.values()),
        "date": a.date,
        "device": a.device,
    }
    with open(a.json, "w") as f:
        json.dump({"summary": summary, "runs": {n: r for n, (_, r) in runs.items()}}, f, indent=1)
    profiled = all("profile" in r for _, r in runs.values())
    extra_h = " GPU-only step ms | launches/step |" if profiled else ""
    lines = [f"# bench_one_batch on {a.device}", "", f"Date: {a.date}. Copy bandwidth measured in the dense "
             f"run: {bw / 1e12:.2f} TB/s. Raw result files: `{a.dir}/`; console output: `{a.dir}/console*.log`.", "",
             *([a.note, ""] if a.note else []),
             "| case | prefill tok/s | decode median ms | decode tok/s | step bytes (MB) | floor ms | over floor | "
             "sparse steps |" + extra_h,
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if profiled else "")]
    for n in CASES:
        meta, r = runs[n]
        fl = r["median_step_bytes"] / meta["copy_bandwidth"]
        extra = ""
        if profiled:
            p = r["profile"]
            extra = (f" {p['gpu_step_median_s'] * 1e3:.3f} | "
                     f"{sum(k['calls_per_step'] for k in p['kernels']):.0f} |")
        lines.append(f"| {n} | {r['prefill_throughput']:.0f} | {r['median_decode_latency'] * 1e3:.2f} | "
                     f"{r['median_decode_throughput']:.1f} | {r['median_step_bytes'] / 1e6:.0f} | {fl * 1e3:.2f} | "
                     f"{r['median_decode_latency'] / fl:.2f} | {r['sparse_steps']}/{r['decode_steps']} |" + extra)
    lines += ["", "## Summary", "", "```json", json.dumps(summary, indent=1), "```", "", "## Commands", ""]
    lines += [f"- `{n}`: `{c}`" for n, c in commands.items()]
    with open(a.md, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
