"""Engine and scheduler configuration: frozen dataclasses (their CLI flags: :mod:`.config_flags`).

Configs hold what the user asked for. Values that depend on the model or the machine (the number of
heavy channels when left unset, pool sizes, the resolved device) are computed by methods/properties
or live in runtime objects (:class:`doublesparse.engine.memory.MemoryPlan`); they are never
written back into a config.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from .attention.adaptive_control import DEFAULT_TARGET_RECALL, AdaptiveConfig
from .attention.budget import BUDGET_MODES, TokenBudget
from .attention.k_rotation import ROTATION_CHOICES as KV_K_ROTATIONS
from .kernels.tuning import KernelTuning

ATTENTION_BACKENDS = ("dense", "double_sparsity", "torch")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DTYPES = ("auto", "float32", "float16", "bfloat16")
CHANNEL_TYPES = ("q", "k", "qk")
# layer: one selection per request shared by every head of a layer (DS-Offload's default: it
# fetches a token's K/V of all heads as one row)
SELECTION_MODES = ("per_head", "group_sum", "group_max", "layer")
# "auto" under DS-Offload: one selection per layer, so that a fetch moves whole tokens
OFFLOAD_SELECTION_MODE = "layer"
# "auto": each layer's mode as its channel config records it (calibration measures it), else this one
DEFAULT_SELECTION_MODE = "group_max"
# what the budget fields mean where nothing filled them in: the engine fills every unset one from
# the model's operating point first (engine/operating_point.py), so these serve direct callers
# of EngineConfig's methods only
DEFAULT_TOKEN_RATIO, DEFAULT_TOKEN_MIN, DEFAULT_TOP_P = 1 / 16, 512, 0.95
SELECTION_MODE_CHOICES = ("auto",) + SELECTION_MODES
LABEL_DTYPES = ("bf16", "fp8")
# "auto": fp8 where the GPU converts e4m3 natively (EngineConfig.label_dtype_for), else bf16
LABEL_DTYPE_CHOICES = ("auto",) + LABEL_DTYPES
# SGLang's --kv-cache-dtype spellings; "auto": the model's dtype
KV_CACHE_DTYPES = ("auto", "bf16", "fp8_e4m3", "fp8_e5m2")
PREFILL_SCHEDULES = ("interleave", "cohort")
OFFLOAD_FETCH = ("reuse", "no-reuse", "full-kv")  # attention/offload.py FETCH_MODES
OFFLOAD_PREFETCH = ("none", "next-layer")  # attention/offload.py PREFETCH_MODES
CPU_DEFAULT_TOTAL_TOKENS = 65536  # no device memory to measure on CPU: a sane fixed pool


def _check_choice(name, value, choices, allow_none=False):
    if value is None and allow_none:
        return
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _check_pos(name, value, allow_none=True, allow_zero=False):
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < (0 if allow_zero else 1):
        bound = ">= 0" if allow_zero else ">= 1"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching policy (capacities such as free KV tokens come from the memory pool at run time).

    max_running_requests: most requests holding KV at once (decode batch size bound).
    chunked_prefill_size: most prompt tokens computed in one prefill forward (across requests).
    prefill_schedule: "interleave" (a prefill chunk and the running decodes in every step) or
        "cohort" (prefill-only steps until the admitted prompts are done, then their first tokens
        together; trades time to first token for time per output token). See
        :mod:`doublesparse.engine.scheduler`.
    disable_radix_cache: no prefix cache (every prompt prefills from scratch, SGLang's flag).
    """

    max_running_requests: int = 64
    chunked_prefill_size: int = 4096
    prefill_schedule: str = "interleave"
    disable_radix_cache: bool = False

    def __post_init__(self):
        _check_pos("max_running_requests", self.max_running_requests, allow_none=False)
        _check_pos("chunked_prefill_size", self.chunked_prefill_size, allow_none=False)
        _check_choice("prefill_schedule", self.prefill_schedule, PREFILL_SCHEDULES)


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to build an :class:`~doublesparse.engine.engine.Engine`.

    ``None`` means "derive": ``dtype`` from the checkpoint/device, ``device`` = cuda if available,
    ``attention_backend`` from ``enable_double_sparsity``. The engine takes the Double Sparsity
    fields left None (``ds_heavy_channel_num``, ``ds_heavy_token_ratio``, ``ds_heavy_token_min``,
    ``ds_num_sink``, ``ds_num_recent``, the top-p budget) and the "auto" selection mode from the
    model's operating point (engine/operating_point.py: the one its channel config records from
    calibration, else one derived from its shape) and reports it as ``Engine.operating_point``;
    the fallbacks below serve direct callers of these methods: ``ds_heavy_channel_num`` = min(16, head_dim // 4),
    ``ds_heavy_token_num`` = None: a per-request budget ``clamp(ceil(ds_heavy_token_ratio x length),
    ds_heavy_token_min, ds_heavy_token_max)`` (max: ratio x max context; ratio and min where unset:
    :data:`DEFAULT_TOKEN_RATIO`, :data:`DEFAULT_TOKEN_MIN`); an int: that fixed k for
    every request (SGLang's meaning). ``ds_budget_mode`` = None: "fixed" with
    ``ds_heavy_token_num``, else "ratio"; "top_p": that budget is each KV head's upper bound and
    ``ds_heavy_token_min`` its lower bound, and each step keeps the fewest selected tokens whose
    estimated attention reaches ``ds_budget_top_p``. ``ds_sparse_decode_threshold`` = None: the automatic
    dense/sparse choice (attention/budget.py); an int: SGLang's meaning (sparse from that length).
    ``ds_label_dtype`` = "auto": fp8 labels on GPUs that convert e4m3 natively for models without
    a K bias, else bf16 (:meth:`label_dtype_for`).
    ``max_total_tokens`` from ``mem_fraction_static``
    (CUDA) or :data:`CPU_DEFAULT_TOTAL_TOKENS` (CPU), ``max_running_requests`` = 64.
    ``disable_cpu_packed_weights``: a model the engine loads onto the CPU decodes with its float
    weights instead of weight-only int4/bf16 copies (models/packed.py).
    ``cpu_threads``: intra-op threads of every CPU step; None: chosen per step from the other
    processes' load on the cores and, for small decode batches, measured step times
    (engine/cpu_threads.py).
    ``kernel_tuning``: the kernels' launch parameters and choices (docs/tuning.md), handed to every
    launch of this engine only. ``tp_size``: tensor-parallel ranks (one process and device each;
    docs/parallelism.md); 1 runs in this process alone.
    ``enable_ds_offload`` and the ``ds_offload_*`` fields: K/V in host
    memory, labels and a hot set on the device (docs/offload.md); ``ds_offload_hot_tokens`` = None:
    2 x the largest top-k; ``ds_offload_host_memory_gb`` = None: 64 GiB on CUDA, 1 on CPU;
    ``ds_offload_device_tokens``: slots whose K/V stay in device memory, for the requests that fit
    there when admitted (0: every request's K/V in host memory).
    ``gpu_memory_budget_gb``: weights + device pools + hot set + workspace must fit (None: no check).
    ``kv_cache_dtype``: the K/V pools' dtype, "auto" = the model's; "fp8_e4m3" / "fp8_e5m2" store
    ``x / scale`` in fp8 with one scale per layer for K and one for V (half the bytes of bf16, so
    twice the tokens in the same memory): from ``kv_cache_scales_path`` (JSON), else the
    checkpoint's ``k_scale`` / ``v_scale`` tensors, else 1.0 (engine/kv_scales.py).
    ``kv_cache_k_rotation``: "auto" rotates q and K per KV head by Hadamard blocks before an fp8
    cache at the default scale 1.0 stores K (scores unchanged; most of fp8's error on K removed;
    attention/k_rotation.py), "hadamard" always, "none" stores K as it is (vLLM's and SGLang's).
    ``ds_recall_sample_interval``: every that many sparse decode steps, the exact attention of
    ``ds_recall_sample_rows`` requests at one layer (rotating) measures the share of it the step's
    selection captured (attention/recall.py, docs/serving-metrics.md); 0: off.
    ``ds_budget_mode`` "adaptive": the ratio budget with a scale per layer that follows that
    sampled recall towards ``ds_target_recall`` (None: :data:`DEFAULT_TARGET_RECALL`), within
    [min, max] of :class:`~doublesparse.attention.adaptive_control.AdaptiveConfig` (the workspace
    holds the largest scale's k) and the cost model (attention/adaptive.py).
    """

    model_path: str | None = None
    load_format: str = "auto"
    dtype: str | None = None
    device: str | None = None
    context_length: int | None = None
    attention_backend: str | None = None
    enable_double_sparsity: bool = False
    ds_channel_config_path: str | None = None
    ds_heavy_channel_num: int | None = None
    ds_heavy_token_num: int | None = None
    ds_heavy_channel_type: str = "qk"
    ds_heavy_token_ratio: float | None = None
    ds_heavy_token_min: int | None = None
    ds_heavy_token_max: int | None = None
    ds_budget_mode: str | None = None
    ds_budget_top_p: float | None = None
    ds_target_recall: float | None = None
    ds_sparse_decode_threshold: int | None = None
    ds_selection_mode: str = "auto"
    ds_label_dtype: str = "auto"
    ds_num_sink: int | None = None
    ds_num_recent: int | None = None
    ds_batch_parts: int | None = None
    ds_recall_sample_interval: int = 64
    ds_recall_sample_rows: int = 4
    kv_cache_dtype: str = "auto"
    kv_cache_scales_path: str | None = None
    kv_cache_k_rotation: str = "auto"
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.85
    chunked_prefill_size: int = 4096
    prefill_schedule: str = "interleave"
    max_running_requests: int | None = None
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 32
    disable_overlap_schedule: bool = False
    disable_radix_cache: bool = False
    disable_cpu_packed_weights: bool = False
    cpu_threads: int | None = None
    seed: int = 0
    tp_size: int = 1
    kernel_tuning: KernelTuning = field(default_factory=KernelTuning)
    # DS-Offload (docs/offload.md): K/V in host memory, labels and a hot set on the device
    enable_ds_offload: bool = False
    ds_offload_host_memory_gb: float | None = None
    ds_offload_hot_tokens: int | None = None
    ds_offload_device_tokens: int = 0
    ds_offload_fetch: str = "reuse"
    ds_offload_prefetch: str = "none"
    gpu_memory_budget_gb: float | None = None

    def __post_init__(self):
        _check_choice("load_format", self.load_format, LOAD_FORMATS)
        _check_choice("dtype", self.dtype, DTYPES, allow_none=True)
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS, allow_none=True)
        _check_choice("ds_heavy_channel_type", self.ds_heavy_channel_type, CHANNEL_TYPES)
        _check_choice("ds_selection_mode", self.ds_selection_mode, SELECTION_MODE_CHOICES)
        _check_choice("ds_label_dtype", self.ds_label_dtype, LABEL_DTYPE_CHOICES)
        _check_choice("prefill_schedule", self.prefill_schedule, PREFILL_SCHEDULES)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("kv_cache_k_rotation", self.kv_cache_k_rotation, KV_K_ROTATIONS)
        if self.kv_cache_scales_path is not None and not self.kv_cache_fp8:
            raise ValueError("kv_cache_scales_path is only read with an fp8 kv_cache_dtype "
                             f"(fp8_e4m3 or fp8_e5m2), got kv_cache_dtype={self.kv_cache_dtype!r}")
        for name in ("ds_heavy_channel_num", "ds_heavy_token_num", "max_total_tokens",
                     "max_running_requests", "context_length"):
            _check_pos(name, getattr(self, name))
        _check_pos("ds_sparse_decode_threshold", self.ds_sparse_decode_threshold, allow_zero=True)
        _check_pos("seed", self.seed, allow_none=False, allow_zero=True)
        _check_pos("ds_heavy_token_min", self.ds_heavy_token_min)
        _check_pos("ds_heavy_token_max", self.ds_heavy_token_max)
        r = self.ds_heavy_token_ratio
        if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 < r <= 1.0):
            raise ValueError(f"ds_heavy_token_ratio must be in (0, 1], got {r!r}")
        for name in ("ds_num_sink", "ds_num_recent"):
            _check_pos(name, getattr(self, name), allow_none=True, allow_zero=True)
        self._check_budget_mode()
        _check_pos("chunked_prefill_size", self.chunked_prefill_size, allow_none=False)
        _check_pos("cuda_graph_max_bs", self.cuda_graph_max_bs, allow_none=False)
        _check_pos("ds_batch_parts", self.ds_batch_parts)
        _check_pos("ds_recall_sample_interval", self.ds_recall_sample_interval, allow_none=False, allow_zero=True)
        _check_pos("ds_recall_sample_rows", self.ds_recall_sample_rows, allow_none=False)
        _check_pos("tp_size", self.tp_size, allow_none=False)
        _check_pos("cpu_threads", self.cpu_threads)
        if not isinstance(self.kernel_tuning, KernelTuning):
            raise ValueError(f"kernel_tuning must be a KernelTuning, got {type(self.kernel_tuning).__name__}")
        if not 0.0 < float(self.mem_fraction_static) < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        self._check_offload()
        if self.attention_backend == "dense" and self.enable_double_sparsity:
            raise ValueError("--attention-backend dense contradicts --enable-double-sparsity; "
                             "use --attention-backend double_sparsity (or torch) with it")

    def _check_offload(self):
        _check_choice("ds_offload_fetch", self.ds_offload_fetch, OFFLOAD_FETCH)
        _check_choice("ds_offload_prefetch", self.ds_offload_prefetch, OFFLOAD_PREFETCH)
        if self.ds_offload_prefetch != "none" and self.ds_offload_fetch != "reuse":
            raise ValueError("--ds-offload-prefetch next-layer needs --ds-offload-fetch reuse")
        _check_pos("ds_offload_hot_tokens", self.ds_offload_hot_tokens)
        d = self.ds_offload_device_tokens
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ValueError(f"ds_offload_device_tokens must be a non-negative int, got {d!r}")
        if d and self.ds_offload_fetch == "full-kv":
            raise ValueError("--ds-offload-device-tokens needs --ds-offload-fetch reuse or no-reuse (full-kv "
                             "reads every token from host memory)")
        for name in ("ds_offload_host_memory_gb", "gpu_memory_budget_gb"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
                raise ValueError(f"{name} must be a positive number of GiB, got {v!r}")
        if self.enable_ds_offload and self.tp_size > 1:
            raise ValueError("--enable-ds-offload runs on a single GPU; it cannot be combined with "
                             f"--tp-size {self.tp_size}")
        if self.enable_ds_offload and self.attention_backend == "dense":
            raise ValueError("--enable-ds-offload decodes with Double Sparsity; it contradicts "
                             f"--attention-backend {self.attention_backend}")

    # ------------------------------------------------------------------ derived (never stored)
    @property
    def kv_cache_fp8(self) -> bool:
        """Whether the K/V pools hold fp8 values (with per-layer scales)."""
        return self.kv_cache_dtype.startswith("fp8")

    @property
    def use_double_sparsity(self) -> bool:
        return (self.enable_double_sparsity or self.attention_backend == "double_sparsity"
                or self.enable_ds_offload)

    @property
    def resolved_attention_backend(self) -> str:
        """Registry name: "dense" | "double_sparsity" | "torch" (torch = pure-PyTorch kernels)."""
        if self.attention_backend is not None:
            return self.attention_backend
        return "double_sparsity" if self.use_double_sparsity else "dense"

    @property
    def kernel_impl(self) -> str:
        """``impl`` passed to :mod:`doublesparse.kernels.ops`."""
        return "torch" if self.attention_backend == "torch" else "auto"

    @property
    def resolved_device(self) -> str:
        if self.device:
            return self.device
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def resolved_max_running_requests(self) -> int:
        return self.max_running_requests or 64

    @property
    def use_cuda_graph(self) -> bool:
        # the "torch" backend runs the PyTorch references, which read lengths on the host:
        # not capturable
        return (self.resolved_device.startswith("cuda") and not self.disable_cuda_graph
                and self.attention_backend != "torch")

    @property
    def selection_mode_fallback(self) -> str:
        """The selection mode of a layer whose channel config records none: the explicit
        ``ds_selection_mode``, or for "auto" :data:`DEFAULT_SELECTION_MODE`. (An explicit mode
        also overrides every recorded one.)"""
        return DEFAULT_SELECTION_MODE if self.ds_selection_mode == "auto" else self.ds_selection_mode

    def label_dtype_for(self, device, k_bias: bool = False) -> str:
        """The label pool's dtype on ``device`` ("bf16" or "fp8"): ``ds_label_dtype``, or for
        "auto" fp8 (e4m3, 1 byte) on NVIDIA GPUs of compute capability 8.9 and later, whose
        store and score kernels convert e4m3 in hardware, else bf16. Labels are read for every
        token every sparse step: fp8 halves those bytes (Llama-3.1-8B at 3 x 60K on an H200:
        DS step 5.88 -> 5.72 ms, results/bench-one-batch-h200.md) at unchanged accuracy on
        SmolLM2-135M (docs/accuracy.md). ``k_bias``: the model's K projection has a bias (Qwen2):
        "auto" keeps bf16 there, since a bias shifts whole channels (Qwen2.5-Coder-1.5B's layer-0
        K bias reaches 354) to where e4m3 at scale 1 steps by 32, coarser than the differences
        between tokens that the scores rank by."""
        if self.ds_label_dtype != "auto":
            return self.ds_label_dtype
        if k_bias:
            return "bf16"
        import torch
        dev = torch.device(device)
        # ROCm also reports device type "cuda"; its fp8 is another format (e4m3fnuz)
        if dev.type != "cuda" or torch.version.hip is not None:
            return "bf16"
        return "fp8" if torch.cuda.get_device_capability(dev) >= (8, 9) else "bf16"

    def heavy_channel_num(self, head_dim: int) -> int:
        # 16 label channels (head_dim / 4 for 64-dim heads, / 8 for 128): labels are the larger
        # part of a sparse step's bytes, and more k buys more accuracy than more r at equal bytes
        # (docs/accuracy.md); Llama-3.1-8B at 3 x 60K decoded in 5.88 ms at r 16 vs 6.16 at r 32.
        r = self.ds_heavy_channel_num or min(16, max(1, head_dim // 4))
        if r > head_dim:
            raise ValueError(f"ds_heavy_channel_num={r} exceeds head_dim={head_dim}")
        return r

    def _check_budget_mode(self):
        _check_choice("ds_budget_mode", self.ds_budget_mode, BUDGET_MODES, allow_none=True)
        p = self.ds_budget_top_p
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0):
            raise ValueError(f"ds_budget_top_p must be in (0, 1], got {p!r}")
        if self.ds_budget_mode == "fixed" and not self.ds_heavy_token_num:
            raise ValueError("ds_budget_mode 'fixed' needs ds_heavy_token_num")
        if self.ds_budget_mode == "ratio" and self.ds_heavy_token_num:
            raise ValueError("ds_budget_mode 'ratio' conflicts with ds_heavy_token_num (a fixed k)")
        if self.ds_budget_mode == "top_p" and self.ds_selection_mode == "layer":
            raise ValueError("ds_budget_mode 'top_p' does not combine with ds_selection_mode 'layer'")
        t = self.ds_target_recall
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 < t < 1.0):
            raise ValueError(f"ds_target_recall must be in (0, 1), got {t!r}")
        if t is not None and self.ds_budget_mode != "adaptive":
            raise ValueError("ds_target_recall needs ds_budget_mode 'adaptive'")
        if self.ds_budget_mode == "adaptive":
            if self.ds_heavy_token_num:
                raise ValueError("ds_budget_mode 'adaptive' scales the ratio budget; it conflicts with "
                                 "ds_heavy_token_num (a fixed k)")
            if not self.ds_recall_sample_interval:
                raise ValueError("ds_budget_mode 'adaptive' follows the sampled recall: it needs "
                                 "ds_recall_sample_interval > 0")
            if self.enable_ds_offload or self.tp_size > 1:
                raise ValueError("ds_budget_mode 'adaptive' needs the sampled recall, which runs with "
                                 "the in-GPU backend on one device (not with enable_ds_offload or tp_size > 1)")

    @property
    def budget_mode(self) -> str:
        """``ds_budget_mode``, or where None: "fixed" with ``ds_heavy_token_num``, else "ratio"."""
        return self.ds_budget_mode or ("fixed" if self.ds_heavy_token_num else "ratio")

    def token_budget(self, max_context_len: int) -> TokenBudget:
        """Each request's k: the fixed ``ds_heavy_token_num`` when given, else the ratio of its
        length clamped to [min, max] (min capped at max: a short-context model gets one k; max
        where unset: the ratio of the max context, times the largest scale in "adaptive" mode). In
        "top_p" mode that k is the upper bound of each KV head's k and ``ds_heavy_token_min``
        (capped the same way) its lower bound."""
        p = DEFAULT_TOP_P if self.ds_budget_top_p is None else self.ds_budget_top_p
        top_p = float(p) if self.budget_mode == "top_p" else 0.0
        k_min = DEFAULT_TOKEN_MIN if self.ds_heavy_token_min is None else self.ds_heavy_token_min
        ratio = DEFAULT_TOKEN_RATIO if self.ds_heavy_token_ratio is None else self.ds_heavy_token_ratio
        if self.ds_heavy_token_num:
            k = self.ds_heavy_token_num
            return TokenBudget(min(k_min, k) if top_p else k, k, 0.0, top_p)
        scale = self.adaptive_config.max_scale if self.budget_mode == "adaptive" else 1.0
        k_max = self.ds_heavy_token_max or min(max_context_len, max(1, math.ceil(ratio * scale * max_context_len)))
        return TokenBudget(min(k_min, k_max), k_max, float(ratio), top_p)

    @property
    def adaptive_config(self) -> AdaptiveConfig:
        """The adaptive budget's controller settings (``ds_budget_mode`` "adaptive")."""
        t = DEFAULT_TARGET_RECALL if self.ds_target_recall is None else float(self.ds_target_recall)
        return AdaptiveConfig(target=t)

    def k_max(self, max_context_len: int) -> int:
        """The largest k any request gets (the decode workspace's size)."""
        return self.token_budget(max_context_len).k_max

    def sink_recent(self, k: int, default: tuple[int, int] = (4, 32)) -> tuple[int, int]:
        """Tokens always selected (first, last), inside k: ``ds_num_sink`` / ``ds_num_recent``,
        where unset ``default`` (the operating point's; 4 sink + 32 recent) scaled down for small k
        (at most k/8 and k/4): on SmolLM2 at 8K (H200, 8 windows) 4 + 32 cut KL(dense||DS)
        of group_max 3.7x at equal bytes, perplexity +4.6% -> +1.3% (results/accuracy-h200.md, docs/accuracy.md)."""
        sink = min(default[0], k // 8) if self.ds_num_sink is None else self.ds_num_sink
        recent = min(default[1], k // 4) if self.ds_num_recent is None else self.ds_num_recent
        if sink + recent > k:
            raise ValueError(f"ds_num_sink + ds_num_recent = {sink + recent} exceeds "
                             f"ds_heavy_token_num = {k}")
        return sink, recent

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(max_running_requests=self.resolved_max_running_requests,
                               chunked_prefill_size=self.chunked_prefill_size,
                               prefill_schedule=self.prefill_schedule,
                               disable_radix_cache=self.disable_radix_cache)

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)
