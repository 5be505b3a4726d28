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

import math

import torch

from ..config import EngineConfig
from ..engine.channel_config import MODES, parse_channels

REFERENCE_RATIO = 1 / 16
CANDIDATES = ("group_sum", "group_max")  # same bytes per step; per_head reads Hq / Hkv x the K/V
POSITIONS_PER_WINDOW = 32


def decode_positions(seq_len: int, count: int = POSITIONS_PER_WINDOW) -> torch.Tensor:
    """``count`` positions spread over the window's second half: ``[count]`` long (0-based, the
    query at position p attends to p + 1 tokens)."""
    lo = seq_len // 2
    count = max(1, min(count, seq_len - lo))
    return torch.linspace(lo, seq_len - 1, count).round().long().unique()


class KeepQK:
    """Attention backend that delegates to ``inner`` and, while ``active``, keeps every layer's
    post-RoPE q at ``positions`` (``[P, Hq, D]`` float32) and k (``[T, Hkv, D]``, the model's
    dtype), on the CPU, one dict per kept window in ``windows``."""

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
            self.windows[-1][layer_id] = (q.detach()[pos].float().cpu(), k.detach().cpu())
        return self.inner.forward(layer_id, q, k, v, batch)

    __call__ = forward


def kept_windows(num_windows: int, keep: int) -> set[int]:
    """Indices of ``keep`` windows spread over ``num_windows``."""
    keep = max(0, min(keep, num_windows))
    return {i * num_windows // keep for i in range(keep)} if keep else set()


def captured_mass(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, channels: torch.Tensor,
                  mode: str, ratio: float = REFERENCE_RATIO) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention mass on the selected tokens and on the best possible k tokens, per position and
    query head: two ``[P, Hq]`` float32.

    q: ``[P, Hq, D]`` at ``positions`` ``[P]``; k: ``[T, Hkv, D]`` (T > every position);
    channels: ``[Hkv, r]`` long. Position p attends to n = p + 1 tokens with budget
    k_p = ceil(ratio * n) and the engine's default sink/recent counts for that k.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    P, hq, D = q.shape
    T, hkv, _ = k.shape
    G = hq // hkv
    r = channels.shape[-1]
    k = k.float()
    n = positions.long() + 1                                               # [P]
    valid = torch.arange(T)[None] < n[:, None]                             # [P, T]
    qg = q.float().view(P, hkv, G, D)
    logits = torch.einsum("pgjd,tgd->pgjt", qg, k) / math.sqrt(D)
    prob = logits.masked_fill(~valid[:, None, None], float("-inf")).softmax(-1)   # [P, Hkv, G, T]
    ch = channels.long()
    qh = qg.gather(3, ch[None, :, None, :].expand(P, hkv, G, r))
    lab = k.gather(2, ch[None].expand(T, hkv, r))
    sc = torch.einsum("pgjr,tgr->pgjt", qh, lab)
    if mode == "group_sum":
        sc = sc.sum(2, keepdim=True)
    elif mode == "group_max":
        sc = sc.amax(2, keepdim=True)
    budgets = [max(1, math.ceil(ratio * int(x))) for x in n]
    base = EngineConfig()
    forced = torch.zeros(P, T, dtype=torch.bool)
    for i, (kp, m) in enumerate(zip(budgets, n.tolist())):
        sink, recent = base.sink_recent(kp)
        forced[i, :sink] = True
        forced[i, max(0, m - recent): m] = True
    sc = sc.masked_fill(forced[:, None, None], float("inf")).masked_fill(~valid[:, None, None], float("-inf"))
    kmax = max(budgets)
    within = torch.arange(kmax)[None] < torch.tensor(budgets)[:, None]     # [P, kmax]
    sel = sc.topk(kmax, -1, sorted=True).indices.expand(P, hkv, G, kmax)
    got = (prob.gather(-1, sel) * within[:, None, None]).sum(-1)
    best = (prob.topk(kmax, -1, sorted=True).values * within[:, None, None]).sum(-1)
    return got.reshape(P, hq), best.reshape(P, hq)


def measure_recall(kept: list[dict], cfg: dict, model_config, positions: torch.Tensor,
                   modes=MODES, channel_type: str = "qk", r: int | None = None) -> dict:
    """Mean recall per mode and layer over the kept windows: ``{"recall": {mode: [L]},
    "oracle": [L]}`` (oracle: the true top-k's mass, the most any selection can capture)."""
    L, D = int(model_config.num_layers), int(model_config.head_dim)
    r = r or EngineConfig().heavy_channel_num(D)
    sums = {m: torch.zeros(L, dtype=torch.float64) for m in modes}
    oracle = torch.zeros(L, dtype=torch.float64)
    count = 0
    for m in modes:
        ch = parse_channels(cfg, model_config, channel_type, r, m)          # [L, Hkv, r]
        for w in kept:
            for i in range(L):
                q, k = w[i]
                got, best = captured_mass(q, k, positions, ch[i], m)
                sums[m][i] += got.double().mean()
                if m == modes[0]:
                    oracle[i] += best.double().mean()
    count = max(1, len(kept))
    return {"recall": {m: (s / count).tolist() for m, s in sums.items()}, "oracle": (oracle / count).tolist()}


def choose_modes(recall: dict[str, list[float]], candidates=CANDIDATES, margin: float = 0.0) -> dict:
    """The mode of each layer: the candidate with the highest recall there, except that a layer
    keeps the model-wide best (highest mean over layers) unless its own best beats it by more
    than ``margin``. Returns ``{"model_best": mode, "per_layer": [L modes]}``."""
    cands = [m for m in candidates if m in recall]
    if not cands:
        raise ValueError(f"no recall measured for any candidate mode {tuple(candidates)}")
    mean = {m: sum(recall[m]) / len(recall[m]) for m in cands}
    model_best = max(cands, key=lambda m: mean[m])
    per_layer = []
    for i in range(len(recall[model_best])):
        best = max(cands, key=lambda m: recall[m][i])
        per_layer.append(best if recall[best][i] > recall[model_best][i] + margin else model_best)
    return {"model_best": model_best, "per_layer": per_layer}
