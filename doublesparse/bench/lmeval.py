"""lm-evaluation-harness against a running ``doublesparse serve``: the Shakespeare task
(``doublesparse/bench/lmeval_tasks/``, built from the evaluation plays by
:mod:`doublesparse.bench.lmeval_data`) through lm-eval's ``local-completions`` model.

    python -m doublesparse.bench.lmeval --base-url http://127.0.0.1:30000 --result-json OUT.json

lm-eval (PyPI ``lm-eval``) must be importable by this interpreter. It tokenizes with the served
model's own tokenizer, saved to a folder from the model (``--model-path``, default the embedded
SmolLM2), and sends token ids, so nothing reaches for the Hugging Face hub. Its log-likelihood and
multiple-choice requests are ``echo`` + ``logprobs`` + ``max_tokens=1`` completions, scored on the
prompt's logprobs (the engine's prefill, dense with or without Double Sparsity); its
generate-until requests decode. The server's ``/metrics`` before and after give the requests it
served, the failed ones, and how many decode steps ran sparse.

Writes the row's JSON: the server's decode settings, each task's metrics (lm-eval's results
file), ``requests`` and ``errors`` (engine requests served and failed, refused requests, and a
failed lm-eval run), decode steps, and each sample's answer (for comparing two servers item by
item: :func:`answers`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent / "lmeval_tasks"
TASKS = ("shakespeare_next_line", "shakespeare_last_word", "shakespeare_next_word")
# each task's headline metric, as lm-eval names it in its results ("metric,filter")
HEADLINE = {"shakespeare_next_line": "acc,none", "shakespeare_last_word": "acc,none",
            "shakespeare_next_word": "exact_match,first_word"}
_METRIC = re.compile(r'^doublesparse_(requests_total|rejected_requests_total|decode_steps_total|'
                     r'sparse_decode_steps_total|prompt_tokens_total)(\{[^}]*\})? ([0-9.e+-]+)$')


def _get(url: str, api_key: str | None = None, timeout: float = 10.0) -> bytes:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
        return r.read()


def scrape(base_url: str, api_key: str | None = None) -> dict:
    """The server's request, prompt-token and decode-step counters: {"served", "failed",
    "refused", "prompt_tokens", "decode_steps", "sparse_decode_steps"}."""
    out = dict(served=0.0, failed=0.0, refused=0.0, prompt_tokens=0.0, decode_steps=0.0,
               sparse_decode_steps=0.0)
    for line in _get(base_url + "/metrics", api_key).decode().splitlines():
        m = _METRIC.match(line)
        if not m:
            continue
        name, labels, v = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "requests_total":
            ok = 'status="stop"' in labels or 'status="length"' in labels
            out["served" if ok else "failed"] += v
        elif name == "rejected_requests_total":
            out["refused"] += v
        else:
            out[name.removesuffix("_total")] += v
    return out


def lm_eval_command(base_url: str, model: str, tokenizer_dir: Path, tasks: list[str],
                    output_dir: Path, limit: int | None, batch_size: int) -> list[str]:
    args = (f"model={model},base_url={base_url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={tokenizer_dir},tokenized_requests=True,num_concurrent=1,max_retries=1,timeout=600")
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
           "--include_path", str(TASKS_DIR), "--tasks", ",".join(tasks), "--batch_size",
           str(batch_size), "--output_path", str(output_dir), "--log_samples", "--seed", "1234"]
    if limit:
        cmd += ["--limit", str(limit)]
    return cmd


def _results_file(output_dir: Path) -> Path | None:
    files = sorted(output_dir.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    return files[-1] if files else None


def answers(output_dir: Path) -> tuple[dict[str, list], dict[str, list]]:
    """From lm-eval's sample logs, in doc order: each task's per-sample headline metric, and
    each generate-until task's generations (for comparing two servers item by item)."""
    scores: dict[str, dict[int, object]] = {}
    texts: dict[str, dict[int, str]] = {}
    for f in output_dir.rglob("samples_*.jsonl"):
        task = re.sub(r"^samples_(.*)_[0-9T:.-]+$", r"\1", f.stem)
        metric = HEADLINE.get(task, "").split(",")[0]
        for line in f.read_text().splitlines():
            s = json.loads(line)
            scores.setdefault(task, {})[int(s["doc_id"])] = s.get(metric)
            if metric == "exact_match":
                texts.setdefault(task, {})[int(s["doc_id"])] = s["resps"][0][0]
    order = lambda d: {t: [v for _, v in sorted(x.items())] for t, x in d.items()}  # noqa: E731
    return order(scores), order(texts)


def run(a: argparse.Namespace) -> dict:
    from doublesparse.models import load_tokenizer

    base = a.base_url.rstrip("/")
    model = json.loads(_get(base + "/v1/models", a.api_key))["data"][0]["id"]
    health = json.loads(_get(base + "/health", a.api_key))
    out_dir = Path(a.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok_dir = out_dir / "tokenizer"
    load_tokenizer(a.model_path).save_pretrained(str(tok_dir))
    before = scrape(base, a.api_key)
    cmd = lm_eval_command(base, model, tok_dir, a.tasks, out_dir / "lm_eval", a.limit, a.batch_size)
    print("[lmeval] " + shlex.join(cmd), flush=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    if a.api_key:
        env["OPENAI_API_KEY"] = a.api_key  # what local-completions sends as its bearer token
    t0, load0 = time.time(), os.getloadavg()[0]
    try:
        rc = subprocess.run(cmd, env=env, timeout=a.timeout).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    wall = time.time() - t0
    after = scrape(base, a.api_key)
    delta = {k: after[k] - before[k] for k in after}
    row = {"label": a.label, "model": model, "decode": health.get("decode"),
           "command": shlex.join(cmd), "lm_eval_exit": rc, "wall_s": round(wall, 1),
           # the machine's 1-minute load average as lm-eval started and ended: other work on the
           # cores stretches the wall time (the scores do not depend on it)
           "load_avg": [round(load0, 2), round(os.getloadavg()[0], 2)],
           "requests": int(delta["served"] + delta["failed"]),
           "errors": int(delta["failed"] + delta["refused"]) + (rc != 0),
           "mean_prompt_tokens": round(delta["prompt_tokens"] / max(delta["served"], 1), 1),
           "decode_steps": int(delta["decode_steps"]),
           "sparse_decode_steps": int(delta["sparse_decode_steps"])}
    res = _results_file(out_dir / "lm_eval")
    if res is not None and rc == 0:
        doc = json.loads(res.read_text())
        row["tasks"] = {t: {k: v for k, v in r.items() if k not in ("name", "alias")}
                        for t, r in doc["results"].items()}
        row["scores"] = {t: doc["results"][t].get(HEADLINE.get(t, "")) for t in doc["results"]}
        row["samples"] = {t: n["effective"] for t, n in doc.get("n-samples", {}).items()}
        row["lm_eval_version"] = doc.get("lm_eval_version")
        row["answers"], row["generations"] = answers(out_dir / "lm_eval")
    else:
        row["error"] = f"lm-eval exit {rc}"
    return row


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m doublesparse.bench.lmeval", description=__doc__.splitlines()[0])
    p.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:30000")
    p.add_argument("--label", default="", help="a name for this server in the result")
    p.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    p.add_argument("--model-path", default=None, help="the served model, for its tokenizer (default: the embedded SmolLM2)")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p.add_argument("--limit", type=int, default=None, help="samples per task (default all)")
    p.add_argument("--batch-size", type=int, default=1, help="prompts per HTTP request (lm-eval's batch_size)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds lm-eval may run")
    p.add_argument("--output-dir", default=None, help="lm-eval's files and the tokenizer (default: a temporary folder)")
    p.add_argument("--result-json", type=Path, required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        a.output_dir = a.output_dir or tmp
        row = run(a)
    a.result_json.parent.mkdir(parents=True, exist_ok=True)
    a.result_json.write_text(json.dumps(row, indent=1) + "\n")
    print(f"[lmeval] {a.label}: scores {row.get('scores')}, {row['requests']} requests, "
          f"{row['errors']} errors, {row['sparse_decode_steps']}/{row['decode_steps']} decode steps sparse",
          flush=True)
    return 0 if "error" not in row and row["errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
