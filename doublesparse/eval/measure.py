"""Perplexity, next-token fidelity and attention fidelity of each setting, on held-out text.

Each window of ``window_len`` tokens is prefilled densely up to ``window_len - decode_len``; the
remaining tokens are decoded through the driver (real kernels), and predictions from decoded
tokens are scored. The dense baseline goes through the same decode path with ``ops.dense_decode``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from doublesparse.kernels import ops

from . import driver
from .settings import Setting


@dataclass
class TextResult:
    """Per setting. ppl over all scored tokens; kl = mean KL(dense || setting) in nats;
    top1 = fraction of tokens whose argmax matches dense; recall/rel_err: per layer means
    (``[L]``, NaN for dense layers), or None when attention fidelity was not measured."""

    setting: Setting
    ppl: float
    nll: float
    kl: float
    top1: float
    tokens: int
    recall: list[float] | None = None
    rel_err: list[float] | None = None
    extra: dict = field(default_factory=dict)


class FidelityObserver:
    """Accumulates per-layer selection recall and relative output error ``|o_ds - o| / |o|``
    (o from ``ops.dense_decode`` on the same q and cache) over the tokens past the dense fallback."""

    def __init__(self, num_layers: int):
        self.recall_sum = torch.zeros(num_layers, dtype=torch.float64)
        self.err_sum = torch.zeros(num_layers, dtype=torch.float64)
        self.count = torch.zeros(num_layers, dtype=torch.float64)

    def __call__(self, layer_id, q, out, view):
        p = view.p
        dense = ops.dense_decode(q, p.k[layer_id], p.v[layer_id], p.req_to_token, view.req_idx,
                                 view.seq_lens, view.sm_scale, ws=view.ws, impl=p.impl).float()
        sparse_rows = (view.seq_lens > view.heavy).cpu()
        if not bool(sparse_rows.any()):
            return
        err = (out.float() - dense).norm(dim=-1) / dense.norm(dim=-1).clamp_min(1e-30)   # [B, Hq]
        rec = driver.selection_recall(q, view, layer_id)                                 # [B, Hq]
        m = sparse_rows
        self.err_sum[layer_id] += err.cpu()[m].mean(-1).double().sum()
        self.recall_sum[layer_id] += rec[m].mean(-1).double().sum()
        self.count[layer_id] += int(m.sum())

    def means(self):
        c = self.count.clamp_min(1)
        nan = self.count == 0
        rec = (self.recall_sum / c).masked_fill(nan, float("nan"))
        err = (self.err_sum / c).masked_fill(nan, float("nan"))
        return rec.tolist(), err.tolist()


def split_windows(ids: list[int], window_len: int, num_windows: int) -> list[list[int]]:
    """``num_windows`` disjoint windows spread over ``ids``; ValueError when the text is short."""
    if len(ids) < window_len * num_windows:
        raise ValueError(f"eval text has {len(ids)} tokens, {num_windows} windows of {window_len} "
                         f"need {window_len * num_windows}")
    slots = len(ids) // window_len
    return [ids[(i * slots // num_windows) * window_len:][:window_len] for i in range(num_windows)]


@torch.inference_mode()
def evaluate_text(model, windows: list[list[int]], decode_len: int, settings: list[Setting],
                  channels_for, device="cpu", fidelity: bool = False, batch_windows: int = 0,
                  progress: bool = True) -> list[TextResult]:
    """Score ``settings`` on ``windows``. ``channels_for(setting) -> [L, Hkv, r]``.

    batch_windows: windows per decode forward (0: all at once); each group is prefilled once and
    reused by every setting.
    """
    c = model.config
    W = len(windows)
    wl = len(windows[0])
    if decode_len < 2 or decode_len >= wl:
        raise ValueError(f"decode_len must be in [2, window_len), got {decode_len} for windows of {wl}")
    group = batch_windows or W
    dense_idx = next((i for i, s in enumerate(settings) if s.kind == "dense"), None)
    order = ([dense_idx] if dense_idx is not None else []) + [i for i in range(len(settings)) if i != dense_idx]
    acc = {i: dict(nll=0.0, kl=0.0, top1=0.0, n=0) for i in range(len(settings))}
    obs = {i: FidelityObserver(int(c.num_layers)) for i in range(len(settings))} if fidelity else {}
    bar = tqdm(total=len(order) * ((W + group - 1) // group), desc="eval text", unit="setting",
               disable=not progress)
    for g0 in range(0, W, group):
        win = windows[g0:g0 + group]
        pools = driver.Pools(c, len(win), wl, device=device, dtype=getattr(model, "dtype", torch.float32))
        prefix = wl - decode_len
        driver.prefill(model, pools, [w[:prefix] for w in win])
        inputs = [w[prefix:-1] for w in win]
        targets = torch.tensor([t for w in win for t in w[prefix + 1:]], device=device)
        ref_logp = None
        for i in order:
            s = settings[i]
            ch = None
            if s.kind == "ds":
                ch = channels_for(s)
                pools.relabel(ch)
            logits = driver.decode_tokens(model, pools, s, ch, inputs, s.heavy_tokens(wl),
                                          observer=obs.get(i) if s.kind == "ds" else None)
            logp = logits.log_softmax(-1)
            a = acc[i]
            a["nll"] += float(-logp.gather(1, targets[:, None]).sum())
            a["n"] += targets.numel()
            if s.kind == "dense":
                ref_logp = logp
            if ref_logp is not None:
                a["kl"] += float((ref_logp.exp() * (ref_logp - logp)).sum())
                a["top1"] += float((ref_logp.argmax(-1) == logp.argmax(-1)).sum())
            bar.update()
    bar.close()
    out = []
    for i, s in enumerate(settings):
        a = acc[i]
        n = max(a["n"], 1)
        nll = a["nll"] / n
        res = TextResult(s, ppl=float(torch.tensor(nll).exp()), nll=nll,
                         kl=a["kl"] / n if dense_idx is not None else float("nan"),
                         top1=a["top1"] / n if dense_idx is not None else float("nan"), tokens=a["n"])
        if i in obs and s.kind == "ds":
            res.recall, res.rel_err = obs[i].means()
        out.append(res)
    return out
