"""The gpu-check suite of benchmarks/run.py: the GPU build proven in one device command.

    python benchmarks/run.py gpu-check            # on the GPU machine, after `run.py unstage`
    python benchmarks/gpu_check.py tests --result-json OUT.json [--workers 4] [--timeout S]

First the whole test suite on the GPU (every test that skips on a CPU runs here: compiled kernels,
CUDA graphs, DS-Offload, tensor parallelism at one rank), on ``--workers`` pytest-xdist workers
sharing the card, and the tests that failed run again one at a time, so a failure that only
sharing the card causes (memory, timing) is told apart from a real one. Beside the tests, on a
lane of its own, one Double Sparsity server (Llama-3.1-8B shapes, dummy weights, a pool of 140K
tokens: it fits an 80 GB card beside the tests) serves one small row of each serving suite:
`serving`, `prefix-cache`, and a 2-minute `soak`. Then one small row of each other GPU suite:
`attention`, `one-batch`, `speedup-map` (dense and DS), `models` (DeepSeek-V2-Lite: MLA and MoE),
`offload` (DS-Offload under a 24 GiB budget). Sizes fit an 80 GB H100 and a 141 GB H200 alike;
every row and the tests stop within the suite's budget (:data:`BUDGET_S`), so the command ends
within 9 minutes on an H100. Result: ``results/gpu-check-<machine>.{md,json}``: passed / failed /
skipped, the failures, and each row's status.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 540
PORT = 30100
TEST_WORKERS = 4
TEST_TIMEOUT_S = 330

_SERVER = (f"python -m doublesparse.launch_server --model-path llama-3.1-8b --load-format dummy "
           f"--context-length 33792 --max-total-tokens 140000 --max-running-requests 32 --port {PORT} "
           "--log-level warning --graceful-shutdown-timeout 10 --enable-double-sparsity --chunked-prefill-size 8192")
_CLIENT = (f"python -m doublesparse.bench_serving --base-url http://127.0.0.1:{PORT} --endpoint generate "
           "--request-rate inf --disable-tqdm --progress-interval 20 --result-json {out}.json")
# an explicit pool: the server lane holds part of the card meanwhile, so the engine's own sizing
# (which wants a whole 128K context) could come up short
_ONE = ("python -m doublesparse.bench_one_batch --load-format dummy --warmup-input-len 1024 --output-len 16 "
        "--cuda-graph-max-bs 4 --result-json {out}.json")
_POOL = "--max-total-tokens 140000"
_MAP = f"{_ONE} {_POOL} --model-path llama-3.1-8b --batch-size 1 4 --input-len 8192 32768 --fill random --skip-unfit"


def _row(name: str, cmd: str, timeout: int = 120, **kw) -> dict:
    return {"name": name, "cmd": cmd, "result": "{out}.json", "timeout": timeout, **kw}


def rows(serving_row) -> list[dict]:
    """The suite's rows (``serving_row``: run.py's server-row builder)."""
    lane = {"lane": "server"}
    return [
        _row("tests", f"python benchmarks/gpu_check.py tests --result-json {{out}}.json --workers {TEST_WORKERS} "
             f"--timeout {TEST_TIMEOUT_S}", TEST_TIMEOUT_S + 60),
        {**serving_row("serving", _SERVER, f"{_CLIENT} --dataset random --num-prompts 16 --input-len 4096 "
                       "--output-len 64 --max-concurrency 8", 120), **lane},
        {**serving_row("prefix-cache", _SERVER, f"{_CLIENT} --dataset-name generated-shared-prefix "
                       "--gsp-num-groups 2 --gsp-prompts-per-group 4 --gsp-system-prompt-len 8192 "
                       "--gsp-question-len 128 --gsp-output-len 32 --max-concurrency 4", 120), **lane},
        {**serving_row("soak", _SERVER, f"python -m doublesparse.bench.soak --base-url http://127.0.0.1:{PORT} "
                       "--duration 120 --concurrency 32 --max-tokens 64 --prompt-words 2000 --burst-words 20000 "
                       "--burst-size 8 --oversize-words 60000 --token-ids --result-json {out}.json", 200),
         **lane, "min_s": 150},
        _row("attention", "python -m doublesparse.bench.attention --batch 3 --ctx 16384 --json {out}.json "
             "--md {out}.md", **lane),
        _row("models", "python -m doublesparse.bench.family_decode --load-format dummy --fill random "
             "--warmup-input-len 1024 --output-len 16 --floor-steps 4 --cuda-graph-max-bs 4 "
             "--model-path deepseek-v2-lite --batch-size 2 --input-len 16384 --max-total-tokens 40000 "
             "--enable-double-sparsity --result-json {out}.json", **lane),
        _row("one-batch", f"{_ONE} {_POOL} --model-path llama-3.1-8b --batch-size 2 --input-len 8192 "
             "--enable-double-sparsity"),
        _row("speedup-map-dense", _MAP),
        _row("speedup-map-ds", f"{_MAP} --enable-double-sparsity"),
        _row("offload", f"{_ONE} --model-path llama-3.1-8b-1m --fill random --batch-size 1 --input-len 32768 "
             "--max-total-tokens 33000 --max-running-requests 1 --ds-heavy-token-num 4096 "
             "--enable-ds-offload --gpu-memory-budget-gb 24"),
    ]


# --- the test row -----------------------------------------------------------------------------

_OUTCOMES = "PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"
_XDIST = re.compile(rf"^\[gw\d+\] (?:\[\s*\d+%\] )?({_OUTCOMES}) (tests/.+?)\s*$")
_PLAIN = re.compile(rf"^(tests/\S.*?) ({_OUTCOMES})(?: |$)")


def _test_id(s: str) -> str:
    """A test id as pytest takes it back: xdist's ``@group`` suffix dropped."""
    return re.sub(r"@tests/[^\[\]]*$", "", s)


def parse_pytest(text: str) -> dict[str, str]:
    """``{test id: outcome}`` from pytest's ``-v`` output (xdist's ``[gwN] [ n%] OUTCOME id`` lines,
    ids as pytest takes them back: xdist's ``@group`` suffix dropped; and plain ``id OUTCOME``
    lines); a failure sticks (an error at teardown after a pass)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = _XDIST.match(line)
        if m:
            test, outcome = _test_id(m[2]), m[1]
        elif (m := _PLAIN.match(line)) is not None:
            test, outcome = m[1], m[2]
        else:
            continue
        if out.get(test) not in ("FAILED", "ERROR"):
            out[test] = outcome
    return out


_REASON = re.compile(r"^(?:FAILED|ERROR) (tests/[^\[\s]+(?:\[[^\]]*\])?)(?: - (.*))?$")


def failure_reasons(text: str) -> dict[str, str]:
    """``{test id: first line of its error}`` from pytest's short summary (``-rfE``)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if (m := _REASON.match(line)) is not None:
            out.setdefault(_test_id(m[1]), (m[2] or "").strip()[:300])
    return out


def _pytest(args: list[str], log: Path, timeout: float) -> tuple[dict[str, str], str]:
    """Run pytest from the repository root -> (outcomes, how it ended)."""
    cmd = [sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", "-o",
           "console_output_style=classic", *args]
    # -rfE cuts each reason to the terminal's width (80 columns in a pipe: "Run..."); widen it
    env = {**os.environ, "COLUMNS": "400"}
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                                env=env).returncode
            how = f"exit {rc}"
        except subprocess.TimeoutExpired:
            how = f"timed out after {timeout:.0f} s"
    return parse_pytest(log.read_text(errors="replace")), how


def run_tests(result: Path, workers: int, timeout: float) -> dict:
    """The whole test suite on ``workers`` workers, then its failures one at a time."""
    t0 = time.time()
    log = result.with_suffix(".log")
    # a test that faults the GPU ends its worker (tests/conftest.py); xdist starts another
    restart = ["--max-worker-restart", "1000"]
    outcome, how = _pytest(["-n", str(workers), "--dist", "loadgroup", *restart, "tests"], log, timeout)
    bad = sorted(t for t, o in outcome.items() if o in ("FAILED", "ERROR"))
    alone: dict[str, str] = {}
    left = timeout - (time.time() - t0)
    if bad and left > 20:
        alone, how_alone = _pytest(["-n", "1", *restart, *bad], log.with_suffix(".alone.log"), left)
        how += f"; failures again one at a time: {how_alone}"
    failed = [t for t in bad if alone.get(t, outcome[t]) in ("FAILED", "ERROR")]
    why = failure_reasons(log.read_text(errors="replace"))
    count = lambda *k: sum(o in k for o in outcome.values())  # noqa: E731
    doc = {"passed": count("PASSED", "XFAIL") + len(bad) - len(failed), "failed": len(failed),
           "skipped": count("SKIPPED"), "failures": failed,
           "failed_only_sharing_the_card": [t for t in bad if t not in failed],
           "reasons": {t: why.get(t, "") for t in bad},  # from the run beside the others
           "workers": workers, "ended": how, "wall_s": round(time.time() - t0, 1)}
    result.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"[gpu-check] tests: {doc['passed']} passed, {doc['failed']} failed, {doc['skipped']} skipped "
          f"({how}, {doc['wall_s']:.0f} s)", flush=True)
    return doc


# --- summary and table ------------------------------------------------------------------------

def row_status(entry: dict) -> str:
    if "skipped" in entry:
        return f"skipped: {entry['skipped']}"
    if entry.get("error"):
        return f"failed: {entry['error']}"
    if entry.get("failed"):  # the tests row, or a client that counted failed requests
        return f"failed: {entry['failed']}"
    return "ok"


def summary(rows: dict, card: str, wall_s: float) -> dict:
    t = rows.get("tests", {})
    status = {n: row_status(e) for n, e in rows.items() if n != "tests"}
    soak = rows.get("soak", {})
    return {"card": card, "wall_min": round(wall_s / 60, 2), "passed": t.get("passed"), "failed": t.get("failed"),
            "skipped": t.get("skipped"), "rows_ok": sum(v == "ok" for v in status.values()),
            "rows_failed": [n for n, v in status.items() if v != "ok"], "rows": status,
            "soak": {k: soak.get(k) for k in ("lost_valid", "http_5xx", "fanout_disconnects",
                                              "rid_collisions_intact", "duplicates_identical",
                                              "metrics_consistent", "rss_growth_pct", "minutes")}}


NOTE = ("The whole test suite on the GPU (its failures again one at a time), then one small row of each "
        "GPU suite, sized to fit an 80 GB card. A row is `ok` when its command exited 0; timings here "
        "are a smoke check (the server lane runs beside the tests), not results: each suite's own run "
        "gives those.")


def table(rows: dict) -> list[str]:
    t = rows.get("tests", {})
    L = [f"Tests: {t.get('passed')} passed, {t.get('failed')} failed, {t.get('skipped')} skipped "
         f"({t.get('ended')}, {t.get('wall_s')} s, {t.get('workers')} workers).", ""]
    why = t.get("reasons", {})
    L += [f"- failed: `{f}`" + (f": {why[f]}" if why.get(f) else "") for f in t.get("failures", [])]
    L += [f"- failed only beside other tests (passed alone): `{f}`" + (f": {why[f]}" if why.get(f) else "")
          for f in t.get("failed_only_sharing_the_card", [])]
    L += ["", "| row | status | wall s |", "|---|---|---|"]
    L += [f"| {n} | {row_status(e)} | {e.get('wall_s', '')} |" for n, e in rows.items() if n != "tests"]
    return L


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/gpu_check.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tests", help="the test suite on the GPU, failures again one at a time")
    t.add_argument("--result-json", type=Path, required=True)
    t.add_argument("--workers", type=int, default=TEST_WORKERS)
    t.add_argument("--timeout", type=float, default=TEST_TIMEOUT_S)
    a = p.parse_args(argv)
    a.result_json.parent.mkdir(parents=True, exist_ok=True)
    doc = run_tests(a.result_json, a.workers, a.timeout)
    return 1 if doc["failed"] or "timed out" in doc["ended"] else 0


if __name__ == "__main__":
    sys.exit(main())
