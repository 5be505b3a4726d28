"""The lm-eval suite of benchmarks/run.py: its rows, summary and table.

lm-evaluation-harness (PyPI ``lm-eval``, importable by the interpreter that runs run.py) scores the
embedded SmolLM2-135M on the CPU through ``doublesparse serve`` with its ``local-completions``
model, on the Shakespeare task that ships with the package (doublesparse/bench/lmeval_tasks/,
built from the evaluation plays): dense, Double Sparsity with the default flags, and Double
Sparsity forced to decode sparsely (16 heavy tokens, every step sparse) on the generate-until task.
Each row is ``python -m doublesparse.bench.lmeval`` against its own server.
"""

from __future__ import annotations

PORT = 30731  # not the servers' default 30000, which another server on the machine may hold
SERVER = (f"python -m doublesparse.launch_server --device cpu --port {PORT} --context-length 2048 "
          "--max-total-tokens 16384 --log-level warning --graceful-shutdown-timeout 10")
CLIENT = (f"python -m doublesparse.bench.lmeval --base-url http://127.0.0.1:{PORT} "
          "--output-dir {out} --result-json {out}.json")
# (row, server flags, client flags)
ROWS = (
    ("dense", "--no-enable-double-sparsity", "--label dense"),
    ("ds", "--enable-double-sparsity", "--label ds"),
    ("ds-sparse", "--enable-double-sparsity --ds-heavy-token-num 16 --ds-sparse-decode-threshold 0",
     "--label ds-sparse --tasks shakespeare_next_word"),
)
HEADLINE_TASK = "shakespeare_next_line"
NOTE = (
    "lm-evaluation-harness's `local-completions` model against `doublesparse serve` on the CPU "
    "(embedded SmolLM2-135M), on the Shakespeare task shipped in `doublesparse/bench/lmeval_tasks/` "
    "(built from the evaluation plays): `next_line` (multiple choice, 4 lines), `last_word` "
    "(log-likelihood: acc = the word is the greedy continuation), `next_word` (generate until a "
    "newline, first word exact match). **The prompts are short** (mean prompt tokens per "
    "request below, a few dozen): the log-likelihood and multiple-choice scores come from the prompt's "
    "logprobs, i.e. the prefill, which is dense with or without Double Sparsity, so `ds` equals "
    "`dense` there by construction; generate-until decodes, and with the default flags Double Sparsity "
    "decodes such short contexts densely too (its top-k is at least 512 tokens, and the automatic "
    "dense/sparse choice picks dense: see the sparse-step column). The `ds-sparse` row forces sparse "
    "decoding (16 heavy tokens, every step sparse) on the generate-until task to show the decode path "
    "the other rows do not exercise; a generation's first token still comes from the (dense) prefill, "
    "so its first word changes only where the word spans several tokens, while the rest of the "
    "generation may differ (`generations_differing_*` in the summary). `dense_acc` / `ds_acc`: "
    "`next_line` accuracy. The servers run with one intra-op thread; wall times depend on what else "
    "ran on the cores (the load average as lm-eval started and ended), the scores do not."
)


# One intra-op thread for the server: on a machine whose 2 cores other work shares, torch's two
# threads made a short prefill 5-10x slower than one (the dense/DS comparison does not depend on it).
ENV = {"OMP_NUM_THREADS": "1"}


def rows(serving_row) -> list[dict]:
    return [{**serving_row(name, f"{SERVER} {flags}", f"{CLIENT} {client}", 1500), "env": ENV}
            for name, flags, client in ROWS]


def _differing(a: dict, b: dict, key: str = "answers") -> dict:
    """Per task, the samples whose outcome (``key``: or generation) differs between two rows."""
    out = {}
    for task, xs in (a.get(key) or {}).items():
        ys = (b.get(key) or {}).get(task)
        if ys is not None:
            out[task] = sum(x != y for x, y in zip(xs, ys))
    return out


def summary(rows: dict) -> dict:
    d, x, f = (rows.get(k, {}) for k in ("dense", "ds", "ds-sparse"))
    ds_scores, dense_scores = x.get("scores") or {}, d.get("scores") or {}
    diffs = [abs(ds_scores[t] - dense_scores[t]) * 100 for t in dense_scores
             if ds_scores.get(t) is not None and dense_scores[t] is not None]
    return {
        "dense_acc": dense_scores.get(HEADLINE_TASK),
        "ds_acc": ds_scores.get(HEADLINE_TASK),
        "headline_task": HEADLINE_TASK,
        "max_abs_diff_points": max(diffs) if diffs else None,
        "scores": {k: r.get("scores") for k, r in rows.items()},
        "samples_differing_dense_vs_ds": _differing(d, x),
        "samples_differing_dense_vs_ds_sparse": _differing(d, f),
        "generations_differing_dense_vs_ds": _differing(d, x, "generations"),
        "generations_differing_dense_vs_ds_sparse": _differing(d, f, "generations"),
        "mean_prompt_tokens": d.get("mean_prompt_tokens"),
        "ds_sparse_decode_steps": f"{x.get('sparse_decode_steps')}/{x.get('decode_steps')}",
        "ds_sparse_row_sparse_decode_steps": f"{f.get('sparse_decode_steps')}/{f.get('decode_steps')}",
        "requests": sum(r.get("requests", 0) for r in rows.values()),
        "errors": sum(r.get("errors", 0) + ("error" in r and "errors" not in r) for r in rows.values()),
    }


def _fmt(v, nd=3) -> str:
    return "" if v is None else f"{v:.{nd}f}"


def table(rows: dict) -> list[str]:
    L = ["| server | next_line acc | next_line acc_norm | last_word acc | last_word perplexity | "
         "next_word exact match | requests | mean prompt tokens | errors | sparse decode steps | "
         "lm-eval wall s | load average |", "|---|" + "---|" * 11]
    for n, r in rows.items():
        t = r.get("tasks") or {}
        nl, lw, nw = (t.get(k, {}) for k in ("shakespeare_next_line", "shakespeare_last_word",
                                              "shakespeare_next_word"))
        L.append(f"| {n} | {_fmt(nl.get('acc,none'))} | {_fmt(nl.get('acc_norm,none'))} | "
                 f"{_fmt(lw.get('acc,none'))} | {_fmt(lw.get('perplexity,none'), 1)} | "
                 f"{_fmt(nw.get('exact_match,first_word'))} | {r.get('requests', '')} | "
                 f"{r.get('mean_prompt_tokens', '')} | {r.get('errors', r.get('error', ''))} | "
                 f"{r.get('sparse_decode_steps', '')}/{r.get('decode_steps', '')} | {r.get('wall_s', '')} | "
                 f"{' -> '.join(str(v) for v in r.get('load_avg') or [])} |")
    return L
