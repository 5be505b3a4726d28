"""Merge the files of a serving run made outside benchmarks/run.py into a serving result file.

    python3 benchmarks/merge_serving.py DIR [DIR ...] [--out-json results/serving-h200.json]
        [--out-md results/serving-h200.md] [--raw-dir DIR]

Each DIR (or a folder below it) holds ``dense.json`` / ``ds.json`` (bench_serving ``--result-json``
of the measured runs), ``malformed-*.json`` (the malformed-request mix), ``env-*.json`` (the
server and bench commands, versions, date) and ``console-*.log``. The summary carries the serving
targets' keys plus the decode-only view (ITL), whether each target was met, and every way the run
differs from the reference workload (100 requests of 32768 + 1024 tokens, 16 in flight).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

WORKLOAD = {"num_prompts": 100, "input_len": 32768, "output_len": 1024, "max_concurrency": 16}
MIXES = ("malformed-generate", "malformed-completions")
CHUNK = 4096  # the engine's default --chunked-prefill-size (a run may pass its own: see _chunk)


def _chunk(cmds: list[str]) -> int:
    """The servers' --chunked-prefill-size (the default when they did not pass one)."""
    for c in cmds:
        m = re.search(r"--chunked-prefill-size[ =](\d+)", c)
        if m:
            return int(m.group(1))
    return CHUNK


def _schedule(cmds: list[str]) -> str:
    """The servers' --prefill-schedule (interleave, the default, when they did not pass one)."""
    for c in cmds:
        m = re.search(r"--prefill-schedule[ =](\w+)", c)
        if m:
            return m.group(1)
    return "interleave"


def find(dirs: list[Path]) -> dict[str, Path]:
    """name (file stem) -> path; a later DIR wins, so a re-run can be merged over an old one."""
    out: dict[str, Path] = {}
    for d in dirs:
        for p in sorted(d.glob("*")) + sorted(d.glob("*/*")):
            if p.is_file() and p.suffix in (".json", ".log", ".txt"):
                out[p.stem if p.suffix == ".json" else p.name] = p
    return out


def load(files: dict[str, Path], name: str) -> dict | None:
    return json.loads(files[name].read_text()) if name in files else None


def ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def throughput(m: dict) -> tuple[float, str]:
    """Output tokens/s over the whole run. When --deadline cut requests, the tokens they streamed
    count too (otherwise a cut run would look slower than it was)."""
    cut = m.get("cancelled_in_flight", 0) + m.get("not_sent", 0)
    if cut:
        return m["output_throughput_incl_cut"], "output_throughput_incl_cut (run cut by deadline)"
    return m["output_throughput"], "output_throughput"


def sparse_share(m: dict):
    c = m.get("server_counters") or {}
    return ratio(c.get("sparse_decode_steps"), c.get("decode_steps"))


def build(files: dict[str, Path]) -> dict:
    runs = {k: load(files, k) for k in ("dense", "ds", *MIXES)}
    envs = {k: load(files, f"env-{k}") for k in ("dense", "ds", "malformed")}
    dense, ds = (runs[k]["metrics"] if runs[k] else None for k in ("dense", "ds"))
    if dense is None or ds is None:
        raise SystemExit(f"need dense.json and ds.json; found {sorted(files)}")
    (tp_d, basis_d), (tp_s, basis_s) = throughput(dense), throughput(ds)
    mixes = {k: runs[k]["metrics"] for k in MIXES if runs[k]}
    s = {
        "ds_over_dense_output_tok_s": ratio(tp_s, tp_d),
        "ds_over_dense_tpot_p50": ratio(ds["tpot_ms_p50"], dense["tpot_ms_p50"]),
        "ds_tpot_p99_ms": ds["tpot_ms_p99"], "dense_tpot_p99_ms": dense["tpot_ms_p99"],
        "failed_requests": dense["errors"] + ds["errors"],
        # a valid request of the mix that did not complete (failed or cut) counts as lost
        "malformed_run_valid_lost": sum(m["valid_requests"] - m["completed"] for m in mixes.values())
        if mixes else None,
        "malformed_sent": sum(m["malformed_sent"] for m in mixes.values()) if mixes else None,
        "malformed_unexpected": sum(m["malformed_unexpected"] for m in mixes.values()) if mixes else None,
        "ds_tpot_p50_ms": ds["tpot_ms_p50"], "dense_tpot_p50_ms": dense["tpot_ms_p50"],
        "ds_over_dense_itl_p50": ratio(ds["itl_ms_p50"], dense["itl_ms_p50"]),
        "ds_itl_p50_ms": ds["itl_ms_p50"], "dense_itl_p50_ms": dense["itl_ms_p50"],
        "ds_itl_p99_ms": ds["itl_ms_p99"], "dense_itl_p99_ms": dense["itl_ms_p99"],
        "ds_output_tok_s": tp_s, "dense_output_tok_s": tp_d,
        "throughput_basis": basis_s if basis_s == basis_d else f"dense: {basis_d}; ds: {basis_s}",
        "ds_sparse_decode_share": sparse_share(ds), "dense_sparse_decode_share": sparse_share(dense),
        "cut_requests": {k: m["cancelled_in_flight"] + m["not_sent"]
                         for k, m in (("dense", dense), ("ds", ds))},
        "output_len_mismatch": {k: m.get("output_len_mismatch") for k, m in (("dense", dense), ("ds", ds))},
    }
    s["targets"] = {
        "ds_over_dense_tpot_p50 <= 0.5": _met(s["ds_over_dense_tpot_p50"], lambda v: v <= 0.5),
        "ds_over_dense_output_tok_s >= 1.4": _met(s["ds_over_dense_output_tok_s"], lambda v: v >= 1.4),
        "failed_requests == 0": _met(s["failed_requests"], lambda v: v == 0),
        "malformed_run_valid_lost == 0": _met(s["malformed_run_valid_lost"], lambda v: v == 0),
    }
    s["deviations"] = deviations(dense, ds, mixes)
    env_any = next((e for e in (envs["ds"], envs["dense"], envs["malformed"]) if e), {})
    s["commands"] = commands(envs, mixes)
    s["prefill_schedule"] = _schedule(s["commands"])
    s["date"] = env_any.get("date")
    s["device"] = device(env_any)
    return {"summary": s, "runs": {k: v for k, v in runs.items() if v}, "env": {k: v for k, v in envs.items() if v}}


def _met(v, test) -> dict:
    return {"value": v, "met": None if v is None else bool(test(v))}


def deviations(dense: dict, ds: dict, mixes: dict) -> list[str]:
    out = []
    for name, m in (("dense", dense), ("ds", ds)):
        for k, want in WORKLOAD.items():
            got = m.get(k) if k != "num_prompts" else m.get("num_requests")
            if got != want:
                out.append(f"{name}: {k} = {got} (the workload: {want})")
        cut = m["cancelled_in_flight"] + m["not_sent"]
        if cut:
            out.append(f"{name}: {cut} requests cut by the --deadline ({m['cancelled_in_flight']} in "
                       f"flight, {m['not_sent']} never sent); TPOT/TTFT cover completed ones only")
    if not mixes:
        out.append("no malformed-mix run")
    return out


def commands(envs: dict, mixes: dict) -> list[str]:
    """Each server's command, then the bench_serving commands run against it."""
    cmds = []
    for k in ("dense", "ds", "malformed"):
        e = envs[k]
        if not e:
            continue
        cmds.append(e["server_cmd"])
        if k != "malformed":
            cmds.append(e["bench_cmd"])
        if mixes and k in ("ds", "malformed"):
            cmds += [e["mix_generate_cmd"], e["mix_completions_cmd"]]
    return cmds


def device(env: dict) -> str:
    gpu = env.get("gpu") or "CPU"
    return f"{gpu}, torch {env.get('torch')}, triton {env.get('triton')}, python {env.get('python')}"


# ------------------------------------------------------------------------------------- markdown
ROWS = [("completed / errors / cut", None), ("duration (s)", "duration_s"),
        ("output tok/s", None), ("TTFT p50 / p99 (ms)", ("ttft_ms_p50", "ttft_ms_p99")),
        ("TPOT mean / p50 / p99 (ms)", ("tpot_ms_mean", "tpot_ms_p50", "tpot_ms_p99")),
        ("ITL p50 / p90 / p99 (ms)", ("itl_ms_p50", "itl_ms_p90", "itl_ms_p99")),
        ("E2E p50 / p99 (s)", None), ("server decode steps (sparse)", None)]


def _f(v, nd=1) -> str:
    return "–" if v is None else f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def _cell(label: str, keys, m: dict) -> str:
    if label.startswith("completed"):
        return f"{m['completed']} / {m['errors']} / {m['cancelled_in_flight'] + m['not_sent']}"
    if label == "output tok/s":
        return _f(throughput(m)[0])
    if label.startswith("E2E"):
        return " / ".join(_f(None if m[k] is None else m[k] / 1e3, 2) for k in ("e2e_ms_p50", "e2e_ms_p99"))
    if label.startswith("server"):
        c = m.get("server_counters") or {}
        return f"{_f(c.get('decode_steps'), 0)} ({_f(c.get('sparse_decode_steps'), 0)})"
    keys = (keys,) if isinstance(keys, str) else keys
    return " / ".join(_f(m.get(k)) for k in keys)


def markdown(doc: dict) -> str:
    s, runs = doc["summary"], doc["runs"]
    d, x = runs["dense"]["metrics"], runs["ds"]["metrics"]
    server = (doc["env"].get("ds") or doc["env"].get("dense") or {}).get("server_cmd", "")
    model = f"`{d['model']}`" + (" with dummy weights (`--load-format dummy`)" if "dummy" in server else "")
    chunk = _chunk(s["commands"])
    C, chunks = d["max_concurrency"], -(-d["input_len"] // chunk)
    L = [f"# Serving benchmark on {s['device']}", "",
         f"Date: {s['date']}. Workload: bench_serving `--endpoint generate` (token ids, streamed), "
         f"{d['num_requests']} requests of {d['input_len']} prompt + {d['output_len']} output tokens "
         f"(ignore_eos), all sent at once, at most {C} in flight; model {model}. "
         "DS: r=16 heavy channels, k = prompt/16 tokens.", ""]
    if s["deviations"]:
        L += ["**Deviations from the reference workload:**", ""] + [f"- {v}" for v in s["deviations"]] + [""]
    L += ["| | dense | Double Sparsity | DS / dense |", "|---|---|---|---|"]
    for label, keys in ROWS:
        r = ""
        if label == "output tok/s":
            r = _f(s["ds_over_dense_output_tok_s"], 2)
        elif label.startswith("TPOT"):
            r = f"p50 {_f(s['ds_over_dense_tpot_p50'], 2)}"
        elif label.startswith("ITL"):
            r = f"p50 {_f(s['ds_over_dense_itl_p50'], 2)}"
        L.append(f"| {label} | {_cell(label, keys, d)} | {_cell(label, keys, x)} | {r} |")
    L += ["", "## Targets", "", "| target | value | met |", "|---|---|---|"]
    for k, t in s["targets"].items():
        L.append(f"| `{k}` | {_f(t['value'], 3)} | {'–' if t['met'] is None else 'yes' if t['met'] else 'NO'} |")
    L += ["", "## Malformed-request mix (10% malformed, on the DS server)", "",
          "| run | valid sent | valid completed | malformed sent | refused with 4xx | unexpected |",
          "|---|---|---|---|---|---|"]
    for k in MIXES:
        if k in runs:
            m = runs[k]["metrics"]
            L.append(f"| {k} ({m['num_requests']} requests, {m['input_len']}+{m['output_len']} tokens) | "
                     f"{m['valid_requests']} | {m['completed']} | {m['malformed_sent']} | "
                     f"{m['malformed_rejected']} | {m['malformed_unexpected']} |")
    L += ["", "## How to read TPOT and ITL", "",
          "TPOT is per request, (latency - TTFT) / (output tokens - 1), then p50/p99 over requests "
          "(the SGLang/vLLM definition). ITL is every gap between streamed chunks over all "
          "requests."]
    if s.get("prefill_schedule") == "cohort":
        L += ["", "Both servers ran `--prefill-schedule cohort`: while prompts wait or are being "
              "prefilled, steps are prefill-only, and the requests prefilled together get their "
              "first tokens in one step, then decode without being stalled by each other's prefill. "
              f"Here the {C} requests in flight arrive and finish together, so every request waits in "
              f"TTFT for the prefill of its whole cohort (~{C} prompts), and TPOT and ITL are decode "
              "steps: their ratio is the decode-only speedup. The same work as with the default "
              "`interleave` schedule is moved from TPOT into TTFT; output tokens/s over the whole run "
              "does not improve (the last, smaller cohort decodes at a lower batch).", ""]
    else:
        L += [f" The engine runs, in every step, one prefill chunk "
              f"(<= {chunk} prompt tokens) and then one decode forward of all running requests, so each "
              f"later arrival's {d['input_len']}-token prefill ({chunks} chunks) stalls the running "
              f"requests' decode for ~{chunks} steps. With {C} requests in flight and arrivals replacing "
              f"finished ones, a request sees about {C - 1} other prefills during its life (fewer in the "
              "first and last wave); that stall is the same for dense and DS "
              "and is added to both TPOTs, which pulls their ratio towards 1. ITL's p50 is a decode "
              "step without prefill (the decode-only speedup), its p99 a step with a prefill chunk in "
              "it.", "",
              "With C requests always in flight, each lives C / (requests per second) (Little's law), "
              "so as long as TTFT is a small part of that life, the TPOT ratio follows the inverse of "
              f"the throughput ratio: here {_f(s['ds_over_dense_tpot_p50'], 3)} against "
              f"1 / {_f(s['ds_over_dense_output_tok_s'], 3)} = "
              f"{_f(1 / s['ds_over_dense_output_tok_s'], 3) if s['ds_over_dense_output_tok_s'] else '–'}. "
              "A TPOT ratio of 0.5 therefore needs about twice dense's output tokens/s over the whole "
              "run, prefill included, or `--prefill-schedule cohort`, which moves the prefill stalls "
              "into TTFT.", ""]
    L += [
          "## Summary", "", "```json", json.dumps(s, indent=1), "```", "", "## Commands", ""]
    L += [f"- `{c}`" for c in s["commands"]]
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dirs", nargs="+", type=Path)
    p.add_argument("--out-json", type=Path, default=Path("results/serving-h200.json"))
    p.add_argument("--out-md", type=Path, default=Path("results/serving-h200.md"))
    p.add_argument("--raw-dir", type=Path, default=None,
                   help="also copy the raw run files (JSON, console logs) here")
    a = p.parse_args(argv)
    files = find(a.dirs)
    doc = build(files)
    a.out_json.parent.mkdir(parents=True, exist_ok=True)
    a.out_json.write_text(json.dumps(doc, indent=1) + "\n")
    a.out_md.write_text(markdown(doc))
    if a.raw_dir:
        a.raw_dir.mkdir(parents=True, exist_ok=True)
        for name, path in files.items():
            if not name.startswith("metrics-"):  # the scrape is in each run's server_counters
                shutil.copy(path, a.raw_dir / path.name)
    print(json.dumps(doc["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
