"""Attention recall of each selection mode on calibration text, and the per-layer choice of mode.

Recall of a mode at one decode position: the fraction of the true attention mass (dense softmax
over every earlier token) that falls on the tokens the mode selects, computed as the engine
selects them: label scores ``q[heavy] . k[heavy]`` with the layer's channels for that mode, the
mode's reduction over the query heads of a KV head, the sink and recent tokens forced in, top-k.
It is averaged over query heads and positions. The reference budget is the engine's default
ratio, k = ceil(n / 16) of the n tokens attended to, with its default sink/recent tokens
(``EngineConfig.sink_recent``), at channel type qk and r = min(16, head_dim / 4).

The q at the sampled positions and every k of a few calibration windows are kept during the
statistics pass (:class:`KeepQK`), so the recall costs no extra forward; the channels it uses
are the final ones, computed from all windows (the recall is measured in-sample).
"""

from __future__ import annotations

import contextlib
import math

import torch

from ..config import EngineConfig
from ..channels import MODES, parse_channels
from .threads import num_threads

REFERENCE_RATIO = 1 / 16
CANDIDATES = ("group_sum", "group_max")  # same bytes per step; per_head reads Hq / Hkv x the K/V
POSITIONS_PER_WINDOW = 32
REFERENCE_MODE = "group_max"  # the engine's default (docs/accuracy.md: lowest KL on SmolLM2)
# A mode is left only for one that misses at least 10 % less attention mass. On SmolLM2 (packaged
# config's meta) group_sum misses at most 4.6 % less than group_max in any layer and 0.9 % more
# over all layers, while its measured KL at 8K is 2.5x group_max's (docs/accuracy.md): gaps of a
# few percent do not rank the two modes.
REL_MARGIN = 0.10


def decode_positions(seq_len: int, count: int = POSITIONS_PER_WINDOW) -> torch.Tensor:
    """``count`` positions spread over the window's second half: ``[count]`` long (0-based, the
    query at position p attends to p + 1 tokens)."""
    lo = seq_len // 2
    count = max(1, min(count, seq_len - lo))
    return torch.linspace(lo, seq_len - 1, count).round().long().unique()


class KeepQK:
    """Attention backend that delegates to ``inner`` and, while ``active``, keeps every layer's
    post-RoPE q at ``positions`` (``[P, Hq, D]`` float32) and k (``[T, Hkv, D]``, the model's
    dtype), on the model's device, one dict per kept window in ``windows``."""

    def __init__(self, inner, positions: torch.Tensor):
        self.inner, self.positions = inner, positions
        self.active = False
        self.windows: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = []

    def start(self, keep: bool) -> None:
        self.active = keep
        if keep:
            self.windows.append({})

    def forward(self, layer_id, q, k, v, batch):
        if self.active:
            pos = self.positions.to(q.device)
            # kept on the model's device (a few windows of k: 30 MB each for a 1.5B model at 2048)
            self.windows[-1][layer_id] = (q.detach()[pos].float(), k.detach().clone())
        return self.inner.forward(layer_id, q, k, v, batch)

    __call__ = forward


def kept_windows(num_windows: int, keep: int) -> set[int]:
    """Indices of ``keep`` windows spread over ``num_windows``."""
    keep = max(0, min(keep, num_windows))
    return {i * num_windows // keep for i in range(keep)} if keep else set()


class Position:
    """The dense attention of the kept queries and what the selection needs, shared by every mode.

    q: ``[P, Hq, D]`` at ``positions`` ``[P]``; k: ``[T, Hkv, D]`` (T > every position), on one
    device. Position p attends to n = p + 1 tokens with budget k_p = ceil(ratio * n) and the
    engine's default sink/recent counts for that k. ``prob``: ``[P, Hkv, G, T]`` float32 softmax;
    ``bias``: ``[P, 1, 1, T]``, +inf on forced tokens, -inf past n, else 0; ``within``:
    ``[P, 1, 1, k_max]``, which of the k_max best ranks fall inside k_p.
    """

    def __init__(self, q, k, positions, ratio: float = REFERENCE_RATIO):
        P, hq, D = q.shape
        T, hkv, _ = k.shape
        dev = k.device
        self.k = k.float()
        self.qg = q.float().view(P, hkv, hq // hkv, D)
        n = positions.long().cpu() + 1
        budgets = [max(1, math.ceil(ratio * int(x))) for x in n]
        bias = torch.zeros(P, T)
        bias[torch.arange(T)[None] >= n[:, None]] = float("-inf")
        base = EngineConfig()
        for i, (kp, m) in enumerate(zip(budgets, n.tolist())):
            sink, recent = base.sink_recent(kp)
            bias[i, :sink] = float("inf")
            bias[i, max(0, m - recent): m] = float("inf")
        self.bias = bias.to(dev)[:, None, None]
        logits = torch.einsum("pgjd,tgd->pgjt", self.qg, self.k) / math.sqrt(D)
        self.prob = (logits + self.bias.clamp_max(0)).softmax(-1)
        self.k_max = max(budgets)
        self.within = (torch.arange(self.k_max)[None] < torch.tensor(budgets)[:, None]).to(dev)[:, None, None]

    def oracle(self) -> torch.Tensor:
        """Mass of the true top-k_p tokens: ``[P, Hkv, G]``."""
        return (self.prob.topk(self.k_max, -1, sorted=True).values * self.within).sum(-1)

    def selected(self, channels: torch.Tensor, mode: str) -> torch.Tensor:
        """Mass on the tokens ``mode`` selects from labels of ``channels`` ``[Hkv, r]``: ``[P, Hkv, G]``."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        P, hkv, G, _ = self.qg.shape
        ch = channels.long().to(self.k.device)
        r = ch.shape[-1]
        qh = self.qg.gather(3, ch[None, :, None, :].expand(P, hkv, G, r))
        lab = self.k.gather(2, ch[None].expand(self.k.shape[0], hkv, r))
        sc = torch.einsum("pgjr,tgr->pgjt", qh, lab)
        if mode == "group_sum":
            sc = sc.sum(2, keepdim=True)
        elif mode == "group_max":
            sc = sc.amax(2, keepdim=True)
        sel = (sc + self.bias).topk(self.k_max, -1, sorted=True).indices.expand(P, hkv, G, self.k_max)
        return (self.prob.gather(-1, sel) * self.within).sum(-1)


def captured_mass(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, channels: torch.Tensor,
                  mode: str, ratio: float = REFERENCE_RATIO) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention mass on the tokens ``mode`` selects and on the best possible k tokens, per
    position and query head: two ``[P, Hq]`` float32 (shapes as :class:`Position`)."""
    pos = Position(q, k, positions, ratio)
    P = q.shape[0]
    return pos.selected(channels, mode).reshape(P, -1), pos.oracle().reshape(P, -1)


@torch.inference_mode()
def measure_recall(kept: list[dict], cfg: dict, model_config, positions: torch.Tensor,
                   modes=MODES, channel_type: str = "qk", r: int | None = None) -> dict:
    """Mean recall per mode and layer over the kept windows: ``{"recall": {mode: [L]},
    "oracle": [L]}`` (oracle: the true top-k's mass, the most any selection can capture).
    Computed where the kept tensors live; on the CPU with one thread (small ops: a second
    thread only adds waiting, measured 0.6 s vs 0.05 s per layer and mode on a loaded 2-core box)."""
    L, D = int(model_config.num_layers), int(model_config.head_dim)
    r = r or EngineConfig().heavy_channel_num(D)
    chans = {m: parse_channels(cfg, model_config, channel_type, r, m) for m in modes}   # [L, Hkv, r]
    sums = {m: torch.zeros(L, dtype=torch.float64) for m in modes}
    oracle = torch.zeros(L, dtype=torch.float64)
    on_cpu = not kept or next(iter(kept[0].values()))[1].device.type == "cpu"
    with num_threads(1) if on_cpu else contextlib.nullcontext():
        for w in kept:
            for i in range(L):
                pos = Position(*w[i], positions)
                oracle[i] += float(pos.oracle().double().mean())
                for m in modes:
                    sums[m][i] += float(pos.selected(chans[m][i], m).double().mean())
    count = max(1, len(kept))
    return {"recall": {m: (s / count).tolist() for m, s in sums.items()}, "oracle": (oracle / count).tolist()}


def choose_modes(recall: dict[str, list[float]], candidates=CANDIDATES, reference: str = REFERENCE_MODE,
                 rel_margin: float = REL_MARGIN) -> dict:
    """The mode of each layer from measured recall (``{mode: [L]}``), in two steps that each
    leave a mode only for a material gain, measured in missed attention mass (1 - recall; a
    decode step's output error grows with it):

    1. model-wide: ``reference`` (the engine's default, chosen on measured perplexity), unless
       another candidate's mean missed mass is lower by more than ``rel_margin`` of its own;
    2. per layer: that mode, unless another candidate misses less than ``1 - rel_margin`` times
       its missed mass in that layer.

    Returns ``{"model_mode": mode, "per_layer": [L modes]}``."""
    cands = [m for m in candidates if m in recall]
    if not cands:
        raise ValueError(f"no recall measured for any candidate mode {tuple(candidates)}")
    miss = {m: [1.0 - x for x in recall[m]] for m in cands}
    mean = {m: sum(v) / len(v) for m, v in miss.items()}
    model = reference if reference in cands else min(cands, key=lambda m: mean[m])
    best = min(cands, key=lambda m: mean[m])
    if mean[best] < (1 - rel_margin) * mean[model]:
        model = best
    per_layer = []
    for i in range(len(miss[model])):
        b = min(cands, key=lambda m: miss[m][i])
        per_layer.append(b if miss[b][i] < (1 - rel_margin) * miss[model][i] else model)
    return {"model_mode": model, "per_layer": per_layer}
