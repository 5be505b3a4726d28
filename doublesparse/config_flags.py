"""The engine's command-line flags (SGLang spelling): :func:`add_cli_args` adds them to a parser,
:func:`from_cli_args` builds the :class:`~doublesparse.config.EngineConfig` the user asked for."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import fields

from .attention.budget import BUDGET_MODES
from .config import (ATTENTION_BACKENDS, CHANNEL_TYPES, CPU_DEFAULT_TOTAL_TOKENS, DTYPES, KV_CACHE_DTYPES,
                     KV_K_ROTATIONS, LABEL_DTYPE_CHOICES, LOAD_FORMATS, OFFLOAD_FETCH, OFFLOAD_PREFETCH,
                     PREFILL_SCHEDULES, SELECTION_MODE_CHOICES, EngineConfig)
from .kernels.tuning import KernelTuning


def add_cli_args(parser: argparse.ArgumentParser, **command_defaults) -> argparse.ArgumentParser:
    """Add the engine flags (SGLang spelling). Every default is None so that only the flags the
    user typed override :class:`EngineConfig` defaults (or a subcommand's own defaults, which
    ``command_defaults`` names so that ``--help`` shows them)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model-path", help="HF dir, .safetensors dir or .gguf; default: embedded SmolLM2-135M")
    g.add_argument("--load-format", choices=LOAD_FORMATS)
    g.add_argument("--dtype", choices=DTYPES, help="weights' dtype (default: bfloat16 on CUDA, float32 on CPU; "
                   "auto: the checkpoint's)")
    g.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda if available)")
    g.add_argument("--context-length", type=int, help="cap the model's max context (default: the model's)")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS,
                   help="default: double_sparsity with --enable-double-sparsity, else dense")
    g.add_argument("--enable-double-sparsity", action=argparse.BooleanOptionalAction, default=None,
                   help="Double Sparsity decode (--no-enable-double-sparsity to turn it off)")
    g.add_argument("--ds-channel-config-path",
                   help="channel config JSON, or auto: calibrate once on the packaged text and cache the "
                        "config under the user cache, keyed by the model file's hash (default: the "
                        "packaged config for the model, else weight-based channels, reported as uncalibrated)")
    g.add_argument("--ds-heavy-channel-num", type=int, help="label channels r (default: from the operating point)")
    g.add_argument("--ds-heavy-token-num", type=int,
                   help="a fixed top-k for every request (default: per request, see the ratio)")
    g.add_argument("--ds-heavy-token-ratio", type=float,
                   help="per-request top-k = ratio x its length, clamped to [min, max] (default: from the "
                        "operating point)")
    g.add_argument("--ds-heavy-token-min", type=int,
                   help="smallest per-request top-k (default: from the operating point)")
    g.add_argument("--ds-heavy-token-max", type=int,
                   help="largest per-request top-k (default ratio x max context)")
    g.add_argument("--ds-budget-mode", choices=BUDGET_MODES,
                   help="fixed: --ds-heavy-token-num for every request; ratio (default without it): "
                        "the ratio of each request's length, clamped to [min, max]; top_p: that k as "
                        "each KV head's upper bound, --ds-heavy-token-min as its lower bound, and per "
                        "step the fewest selected tokens whose estimated attention reaches "
                        "--ds-budget-top-p; adaptive: the ratio budget, each layer's scaled so that its "
                        "sampled attention recall reaches --ds-target-recall (docs/serving-metrics.md)")
    g.add_argument("--ds-budget-top-p", type=float, metavar="P",
                   help="attention mass the top_p budget keeps per KV head, in (0, 1] (default: the operating "
                        "point's, else 0.95)")
    g.add_argument("--ds-target-recall", type=float, metavar="R",
                   help="the sampled attention recall each layer's budget aims at with --ds-budget-mode "
                        "adaptive, in (0, 1) (default 0.95)")
    g.add_argument("--ds-heavy-channel-type", choices=CHANNEL_TYPES)
    g.add_argument("--ds-sparse-decode-threshold", type=_threshold, metavar="{auto,N}",
                   help="auto (default): decode a step sparsely when a cost model of the bytes and "
                        "fixed launch time of each path says it wins; N: sparsely for requests of at "
                        "least N tokens (and more than their k)")
    g.add_argument("--ds-selection-mode", choices=SELECTION_MODE_CHOICES,
                   help="auto (default): the operating point's (each layer's mode as the channel config "
                        "records it, else from the model's query-group width; with --enable-ds-offload "
                        "layer); a mode: that one for every layer (layer: one selection shared by every "
                        "head of a layer)")
    g.add_argument("--ds-label-dtype", choices=LABEL_DTYPE_CHOICES,
                   help="label cache dtype; auto (default): fp8 (e4m3) on NVIDIA GPUs of compute "
                        "capability 8.9+ (Ada, Hopper and later) unless the model's K projection "
                        "has a bias (Qwen2), else bf16")
    g.add_argument("--ds-num-sink", type=int,
                   help="first tokens always selected (default: from the operating point; at most k/8)")
    g.add_argument("--ds-num-recent", type=int,
                   help="last tokens always selected (default: from the operating point; at most k/4)")
    g.add_argument("--ds-batch-parts", type=int,
                   help="cut a sparse decode batch into this many parts, each on its own CUDA stream, "
                        "so one part's top-k select overlaps another's scoring and attention "
                        "(default: 2 from 16 requests, else 1)")
    g.add_argument("--ds-recall-sample-interval", type=int, metavar="N",
                   help="every N sparse decode steps, measure the attention recall of the step's selection "
                        "exactly at one layer (rotating) for a few requests: /metrics "
                        "doublesparse_ds_attention_recall (0: off; default 64)")
    g.add_argument("--ds-recall-sample-rows", type=int, metavar="N",
                   help="most requests measured per sampled step (default 4)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                   help="K/V cache dtype; auto: the model's; fp8_e4m3 / fp8_e5m2: fp8 values with a "
                        "scale per layer for K and for V, twice the tokens of bf16 in the same memory "
                        "(labels keep --ds-label-dtype; with --enable-ds-offload fp8 rows halve the PCIe bytes; not "
                        "for MLA models)")
    g.add_argument("--kv-cache-scales-path", metavar="FILE.json",
                   help="fp8 K/V scales: JSON {\"k_scale\": x or [per layer], \"v_scale\": ...} "
                        "(default: the checkpoint's k_scale/v_scale tensors, else 1.0)")
    g.add_argument("--kv-cache-k-rotation", choices=KV_K_ROTATIONS,
                   help="auto (default): with an fp8 K/V cache at the default scale 1.0, rotate q and K "
                        "per KV head by Hadamard blocks before K is stored (scores unchanged, most of "
                        "fp8's error on K removed; Double Sparsity's label channels keep their own "
                        "block); hadamard: always; none: store K as it is")
    g.add_argument("--max-total-tokens", type=int,
                   help=f"KV pool size in tokens (default: from --mem-fraction-static on CUDA, "
                        f"{CPU_DEFAULT_TOTAL_TOKENS} on CPU)")
    g.add_argument("--mem-fraction-static", type=float,
                   help="share of the GPU's memory for the weights and the KV pool")
    g.add_argument("--chunked-prefill-size", type=int, help="most prompt tokens in one prefill forward")
    g.add_argument("--prefill-schedule", choices=PREFILL_SCHEDULES,
                   help="interleave (default): a prefill chunk and the running decodes in every step; "
                        "cohort: prefill-only steps until the admitted prompts are done, then their "
                        "first tokens together (higher time to first token, lower time per output token)")
    g.add_argument("--max-running-requests", type=int, help="most requests decoding at once (default: 64)")
    g.add_argument("--disable-cuda-graph", action="store_true", default=None)
    g.add_argument("--cuda-graph-max-bs", type=int, help="largest decode batch run as a CUDA graph")
    g.add_argument("--disable-overlap-schedule", action="store_true", default=None,
                   help="process each step's tokens before launching the next (default on CUDA: "
                        "launch step n+1, then process step n's tokens while the GPU computes)")
    g.add_argument("--disable-radix-cache", action="store_true", default=None,
                   help="no prefix cache: every prompt prefills from scratch (default: requests "
                        "reuse the K/V and labels of cached prefixes)")
    g.add_argument("--disable-cpu-packed-weights", action="store_true", default=None,
                   help="CPU decode multiplies by the float weights (bit-exact, slower; default: by "
                        "weight-only int4/bf16 copies with bf16 activations, see docs/cpu-decode.md)")
    g.add_argument("--cpu-threads", type=int, metavar="N",
                   help="intra-op threads of every CPU step (default: per step, the cores other "
                        "processes leave free; a small decode batch also times 1 thread against "
                        "them)")
    g.add_argument("--seed", type=int, help="sampling seed of the engine")
    g.add_argument("--tp-size", type=int,
                   help="tensor parallelism: split the model over this many devices, one process each "
                        "(rank 0 schedules; see docs/parallelism.md)")
    g.add_argument("--kernel-tuning", dest="kernel_tuning", metavar="FILE.json", type=_kernel_tuning_file,
                   help="JSON object of kernel launch parameters overriding the defaults "
                        "(field names of doublesparse.kernels.tuning.KernelTuning; see docs/tuning.md)")
    g.add_argument("--enable-ds-offload", action="store_true", default=None,
                   help="DS-Offload: keep K/V in host memory (pinned on CUDA) and only labels and a per-request "
                        "hot set of K/V on the device; each step fetches the selected rows not in the hot set "
                        "(implies Double Sparsity; docs/offload.md)")
    g.add_argument("--ds-offload-host-memory-gb", type=float, metavar="GiB",
                   help="most host memory the offloaded K/V may take; sizes the host store when "
                        "--max-total-tokens is not given (default: 64 on CUDA, 1 on CPU)")
    g.add_argument("--ds-offload-device-tokens", type=int,
                   help="K/V slots kept in GPU memory: a request whose tokens fit there when admitted keeps its "
                        "K/V on the GPU (its hot-set misses are device copies), the others go to host memory "
                        "(default: 0, every request offloaded)")
    g.add_argument("--ds-offload-hot-tokens", type=int,
                   help="hot-set rows per request, layer and KV head (default: 2 x the largest top-k)")
    g.add_argument("--ds-offload-fetch", choices=OFFLOAD_FETCH,
                   help="reuse: fetch only selected rows missing from the hot set (LRU); no-reuse: fetch "
                        "every selected row every step; full-kv: dense attention over the whole K/V read "
                        "from host memory each step")
    g.add_argument("--ds-offload-prefetch", choices=OFFLOAD_PREFETCH,
                   help="none: fetch each layer's misses when the layer runs; next-layer: also predict layer "
                        "l+1's selection from layer l's query and fetch it early (on CUDA on a side stream, "
                        "overlapping layer l), fixing up the misses when l+1 runs")
    g.add_argument("--gpu-memory-budget-gb", type=float, metavar="GiB",
                   help="hold the engine's GPU memory (weights, pools, hot set, workspace) to this budget, "
                        "as on a smaller card; startup fails with what does not fit")
    _show_defaults(g, command_defaults)
    return parser


def _show_defaults(group, command_defaults: dict) -> None:
    """Append each flag's effective default to its help, unless the help already says it (a
    default of None is derived: the help explains it)."""
    field_defaults = {f.name: f.default for f in fields(EngineConfig)}
    for a in group._group_actions:
        d = command_defaults.get(a.dest, field_defaults.get(a.dest))
        store_true = d is False and a.const is True
        if "default" in (a.help or "") or d is None or d is dataclasses.MISSING or store_true:
            continue
        if isinstance(d, bool):
            d = "on" if d else "off"
        elif isinstance(d, float):
            d = round(d, 6)
        a.help = f"{a.help} (default: {d})" if a.help else f"default: {d}"


def _kernel_tuning_file(path: str) -> KernelTuning:
    try:
        return KernelTuning.from_json(path)
    except (OSError, ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"{path}: {e}") from e


def _threshold(v: str):
    if v == "auto":
        return "auto"
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer, got {v!r}") from None


def from_cli_args(ns: argparse.Namespace, **defaults) -> EngineConfig:
    """Build an EngineConfig from parsed flags; ``defaults`` apply where a flag was not given."""
    kw = dict(defaults)
    for f in fields(EngineConfig):
        v = getattr(ns, f.name, None)
        if v is not None:
            kw[f.name] = v
    if kw.get("ds_sparse_decode_threshold") == "auto":
        kw["ds_sparse_decode_threshold"] = None
    return EngineConfig(**kw)
