"""Kernel launch settings as one immutable value, passed explicitly from the engine config down to
every launcher (no environment variable or module global changes kernel behaviour).

Defaults were measured on an H200 (docs/tuning.md lists each with its figure). Override them with
``--kernel-tuning FILE.json`` (a JSON object of field: value) or
``EngineConfig(kernel_tuning=KernelTuning(...))``; benchmarks build variants with ``replace``.
This module imports nothing from the launchers, so any of them may import it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

SCORE_IMPLS = ("auto", "cuda", "mma", "rows")
SELECT_IMPLS = ("auto", "cuda", "triton")


@dataclass(frozen=True)
class KernelTuning:
    """Every launch parameter and kernel choice of the decode step (hashable: usable as a cache key).

    Grid sizes are "programs per SM" (times the SM count, capped by the work); ``*_warps`` and
    ``*_stages`` are Triton's num_warps / num_stages; ``*_loop_stages`` a loop's ``tl.range``
    pipelining depth (1 = none).
    """

    # Dense / sparse attention (decode_attn.py). Few (request, head) rows: short tiles and many
    # splits keep enough loads in flight; from one row per SM, long tiles amortize the per-tile
    # softmax work.
    attn_block_n: int = 64
    attn_block_n_many_rows: int = 128
    attn_warps: int = 4
    attn_stages: int = 2
    attn_programs_per_sm: int = 4
    sparse_attn_programs_per_sm: int = 4
    sparse_attn_stages: int = 2

    # DS score: "auto" = the CUDA score (kernels/cuda/) where it runs and either Hkv * r <=
    # mma_max_channels or its tensor-core kernel fits; else "mma" (all KV heads per program, one
    # tensor-core product, ds_score.py) while Hkv * r <= mma_max_channels, else "rows" (one KV head
    # per program, ds_score_rows.py): mma's product is block-diagonal over KV heads, so its waste
    # grows with Hkv.
    score_impl: str = "auto"
    mma_max_channels: int = 256
    mma_block_n: int = 64
    mma_programs_per_sm: int = 4
    mma_warps: int = 4
    # The rows score kernel.
    score_block_n: int = 256
    score_programs_per_sm: int = 8
    score_warps: int = 4
    score_stages: int = 3
    score_loop_stages: int = 3
    # The CUDA score (score.cu): programs per SM, label rows in flight per thread, blocks per SM
    # its registers must allow (2: 128 registers); score_cuda_hist: it makes the select's first
    # phase where the histogram fits shared memory.
    score_cuda_programs_per_sm: int = 2
    score_cuda_rows_per_thread: int = 4
    score_cuda_min_blocks: int = 2
    score_cuda_hist: bool = True
    # Its tensor-core kernel (score_tc.cu) where the shapes allow: 16-token tiles per warp per
    # step, a ring of that many steps in registers (tiles, then depth, capped by registers), at
    # most that many KV heads per warp.
    score_cuda_tc: bool = True
    score_cuda_tc_tiles: int = 2
    score_cuda_tc_depth: int = 3
    score_cuda_tc_max_heads_per_warp: int = 8

    # DS top-k select: "auto" = select.cu (NVRTC) where it runs, else Triton (ds_select.py).
    select_impl: str = "auto"
    # Phases 2 and 3 (at most workspace.SELECT_MAX_PROGS programs per row).
    select_block_n: int = 1024
    select_warps: int = 4
    select_programs_per_sm: int = 4
    select_stages: int = 3
    select_loop_stages: int = 1
    compact_loop_stages: int = 1
    # Phase 1 (high-byte histogram).
    hist_block_n: int = 4096
    hist_programs_per_sm: int = 8
    # The top-p budget's two launches (ds_topp.py): the softmax denominator over a row's scores
    # (at most workspace.TOPP_MAX_PROGS programs per row), then the keep decision per row over
    # its whole selection in one block (warps for up to k_max entries in registers).
    topp_block_n: int = 1024
    topp_programs_per_sm: int = 4
    topp_warps: int = 4
    topp_keep_warps: int = 8

    # Programmatic dependent launch (Hopper and later) for the small per-row kernels and the GEMV;
    # False also turns the GEMV and the split-K GEMM off (they need it to pay).
    pdl: bool = True
    # Decode projections of <= 4 rows with weights of at most this many bytes run through the
    # Triton GEMV; 0 = never.
    gemv_max_bytes: int = 8 << 20
    # Decode projections of at most this many rows (<= 16) and larger bf16 / fp16 weights run
    # through the one-launch split-K GEMM; 0 = never.
    skinny_max_rows: int = 4
    # Query heads one latent-attention program holds (latent_attn.py); more heads run as several
    # programs per (request, split), each reading the latent rows again.
    latent_max_heads: int = 64
    # Routed experts of an MoE layer (kernels/triton/moe_decode.py): steps of at most this many
    # tokens (decode) take the expert-major decode path, each touched expert's weights streamed
    # once by programs of one expert x one narrow N tile; larger ones the grouped GEMM (moe.py).
    # 0 = never: on an H100 (bench.moe_experts, Qwen3-30B-A3B and DeepSeek-V2-Lite shapes) the
    # grouped GEMM read the touched experts at 0.62-0.78 of the copy bandwidth at 4-64 tokens,
    # the decode path at 0.50-0.65. Its tiles: gate + up rows, down rows per program, the K step.
    moe_decode_max_tokens: int = 0
    moe_gate_up_block_n: int = 16
    moe_down_block_n: int = 32
    moe_decode_block_k: int = 128
    moe_decode_warps: int = 8
    moe_decode_stages: int = 4
    # The shared experts' MLP in the decode path's two launches (one more expert that every token
    # takes), instead of their own three (gate_up, SiLU-mul, down) with the output added there.
    moe_fuse_shared: bool = True

    # Fused layer kernels on CUDA (models/layers.py, models/llama.py): "auto" = on CUDA tensors,
    # True = also on CPU (the Triton interpreter: tests), False = the PyTorch ops.
    fused_norm: bool | str = "auto"
    fused_silu_mul: bool | str = "auto"
    fused_rope_store: bool | str = "auto"
    # The Triton expert paths of an MoE layer (grouped GEMM, decode path): "auto" = on CUDA, True =
    # also on CPU (the interpreter: tests), False = the PyTorch path.
    fused_moe: bool | str = "auto"
    # Where fused_moe runs the Triton expert paths: the router's softmax / top-k / renormalisation
    # and the grouped GEMM's block layout as one launch each (kernels/triton/moe_route.py, moe.py)
    # instead of ~30 small device ops a layer; False keeps the device ops (a measurement's peer).
    fused_moe_routing: bool = True
    # MLA's steps around attention at decode sizes in one launch each (kernels/triton/mla_proj.py:
    # the absorbed query with the latent row, and the value half out): "auto" = on CUDA, True = also
    # on CPU (the interpreter: tests), False = the PyTorch ops.
    fused_mla: bool | str = "auto"
    # Prefill of a chunk after a cached prefix as two cuDNN calls merged by log-sum-exp
    # (attention/prefill.py): None = on CUDA for chunks of at least prefill.SPLIT_MIN_TOKENS,
    # True = wherever the inputs allow (CPU included: tests), False = never.
    prefill_split_prefix: bool | None = None
    # Distinct problem shapes a backend lets cuDNN's attention build an execution graph for
    # (attention/prefill.py: CudnnShapes); torch never frees one (~1.2 MB of host memory per new
    # prompt length in `python benchmarks/run.py heap` on an H100), so past this many new shapes
    # run on flash.
    cudnn_graphs: int = 256

    # The automatic dense/sparse choice of a decode step (attention/budget.py): the bandwidth the
    # decode kernels reach, and the fixed time the sparse path's extra launches (score, select)
    # add to a step per layer; on CUDA (H200: copy bandwidth; the extra time of the DS step over
    # its byte floor beside dense's, at 1 x 16K) and on the CPU's PyTorch path (2-core CPU machine,
    # `python benchmarks/run.py decode-cost`, which measures them on any machine).
    decode_bandwidth_gbs: float = 4240.0
    ds_step_overhead_us_per_layer: float = 15.0
    cpu_decode_bandwidth_gbs: float = 6.26
    cpu_ds_step_overhead_us_per_layer: float = 442.0

    def __post_init__(self):
        def bad(name, want):
            raise ValueError(f"KernelTuning.{name} must be {want}, got {getattr(self, name)!r}")

        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "int" and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                bad(f.name, "a non-negative int")
            if f.type == "bool" and not isinstance(v, bool):
                bad(f.name, "true or false")
            if f.type == "float" and (not isinstance(v, (int, float)) or isinstance(v, bool)
                                      or not v > 0 or v == float("inf")):
                bad(f.name, "a positive number")
        if self.score_impl not in SCORE_IMPLS:
            bad("score_impl", f"one of {SCORE_IMPLS}")
        if self.select_impl not in SELECT_IMPLS:
            bad("select_impl", f"one of {SELECT_IMPLS}")
        for name in ("fused_norm", "fused_silu_mul", "fused_rope_store", "fused_moe", "fused_mla"):
            v = getattr(self, name)
            if not (v == "auto" or isinstance(v, bool)):
                bad(name, '"auto", true or false')
        if not isinstance(self.prefill_split_prefix, (bool, type(None))):
            bad("prefill_split_prefix", "null, true or false")
        for name in ("attn_block_n", "attn_block_n_many_rows", "attn_warps", "attn_programs_per_sm",
                     "sparse_attn_programs_per_sm", "mma_block_n", "mma_programs_per_sm", "mma_warps",
                     "score_block_n", "score_programs_per_sm", "score_warps", "score_loop_stages",
                     "score_cuda_programs_per_sm", "score_cuda_rows_per_thread", "score_cuda_min_blocks",
                     "score_cuda_tc_tiles", "score_cuda_tc_max_heads_per_warp", "select_block_n",
                     "select_warps", "select_programs_per_sm", "select_loop_stages", "compact_loop_stages",
                     "hist_block_n", "hist_programs_per_sm", "topp_block_n", "topp_programs_per_sm",
                     "topp_warps", "topp_keep_warps", "latent_max_heads",
                     "moe_gate_up_block_n", "moe_down_block_n", "moe_decode_block_k", "moe_decode_warps",
                     "moe_decode_stages"):
            if getattr(self, name) < 1:
                bad(name, "at least 1")
        for name in ("moe_gate_up_block_n", "moe_down_block_n", "moe_decode_block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                bad(name, "a power of two of at least 16 (a tl.dot tile)")
        if self.score_cuda_tc_depth < 2:
            bad("score_cuda_tc_depth", "at least 2")

    # ------------------------------------------------------------------------- derived
    def decode_cost_figures(self, device_type: str) -> tuple[float, float]:
        """(bytes/s, seconds per layer) of the dense/sparse cost model on this kind of device."""
        if device_type == "cuda":
            return self.decode_bandwidth_gbs * 1e9, self.ds_step_overhead_us_per_layer * 1e-6
        return self.cpu_decode_bandwidth_gbs * 1e9, self.cpu_ds_step_overhead_us_per_layer * 1e-6

    @property
    def max_score_block(self) -> int:
        """The widest block any score or select kernel reads of a score row (must fit the
        workspace's padding)."""
        return max(self.select_block_n, self.score_block_n, self.hist_block_n, self.topp_block_n)

    # ------------------------------------------------------------------------- building
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def _check_keys(cls, keys) -> None:
        unknown = sorted(set(keys) - set(cls.field_names()))
        if unknown:
            raise ValueError(f"unknown kernel tuning keys {unknown}; known: {sorted(cls.field_names())}")

    @classmethod
    def from_dict(cls, d: dict) -> "KernelTuning":
        """Defaults with ``d``'s entries; an unknown key (a removed or misspelt knob) is an error,
        so a benchmark never times the defaults under a name it did not mean."""
        if not isinstance(d, dict):
            raise ValueError(f"kernel tuning must be a JSON object, got {type(d).__name__}")
        cls._check_keys(d)
        return cls(**d)

    @classmethod
    def from_json(cls, path) -> "KernelTuning":
        """``from_dict`` of the JSON object in file ``path``."""
        with open(path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"kernel tuning file {path}: {e}") from e
        return cls.from_dict(d)

    def replace(self, **changes) -> "KernelTuning":
        """A copy with ``changes``; unknown keys are an error."""
        self._check_keys(changes)
        return dataclasses.replace(self, **changes)

    def asdict(self) -> dict:
        """Every field, JSON-ready (for benchmark records)."""
        return dataclasses.asdict(self)


DEFAULT_TUNING = KernelTuning()
