"""Perplexity, next-token fidelity and attention fidelity of each setting, on held-out text.

Each window of ``window_len`` tokens is prefilled densely up to ``window_len - decode_len``; the
remaining tokens are decoded through the driver (real kernels), and predictions from decoded
tokens are scored. The dense baseline goes through the same decode path with ``ops.dense_decode``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from doublesparse.kernels import ops

from . import driver
from .settings import DENSE, Setting


@dataclass
class TextResult:
    """Per setting. ppl over all scored tokens; kl = mean KL(dense || setting) in nats;
    top1 = fraction of tokens whose argmax matches dense; recall/rel_err: per layer means
    (``[L]``, NaN for dense layers), or None when attention fidelity was not measured; mass: per
    layer, the selection's share of the whole exact attention (recall is that share over the true
    top-k's share; mass is what the server's sampled recall measures, docs/serving-metrics.md)."""

    setting: Setting
    ppl: float
    nll: float
    kl: float
    top1: float
    tokens: int
    recall: list[float] | None = None
    rel_err: list[float] | None = None
    mass: list[float] | None = None
    extra: dict = field(default_factory=dict)


class FidelityObserver:
    """Accumulates per-layer selection recall, attention mass (driver.selection_recall) and
    relative output error ``|o_ds - o| / |o|`` (o from ``ops.dense_decode`` on the same q and
    cache) over the tokens past the dense fallback.

    stride: observe every ``stride``-th decoded token only (the recall recomputes the selection
    in float32, the costly part); chunk: requests per recall chunk (GPU: bigger); per_row: also
    keep each observed token's values, ``self.per_row[layer]``: a list of ``(rows [b] int64,
    recall [b], mass [b])`` (means over query heads; rows index the decode batch, request-major)."""

    def __init__(self, num_layers: int, stride: int = 1, chunk: int = 64, per_row: bool = False):
        self.stride, self.chunk = max(1, int(stride)), int(chunk)
        self.per_row: dict[int, list] | None = {} if per_row else None
        self.recall_sum = torch.zeros(num_layers, dtype=torch.float64)
        self.err_sum = torch.zeros(num_layers, dtype=torch.float64)
        self.mass_sum = torch.zeros(num_layers, dtype=torch.float64)
        self.count = torch.zeros(num_layers, dtype=torch.float64)

    def __call__(self, layer_id, q, out, view):
        p = view.p
        rows = torch.arange(0, q.shape[0], self.stride, device=q.device)
        rows = rows[view.seq_lens[rows] > view.k_max]             # rows that decoded sparsely
        if rows.numel() == 0:
            return
        dense = ops.dense_decode(q, p.k[layer_id], p.v[layer_id], p.req_to_token, view.req_idx,
                                 view.seq_lens, view.sm_scale, ws=view.ws, impl=p.impl, **p.scales).float()[rows]
        err = (out.float()[rows] - dense).norm(dim=-1) / dense.norm(dim=-1).clamp_min(1e-30)  # [b, Hq]
        rec, mass = driver.selection_recall(q, view, layer_id, chunk=self.chunk, rows=rows,
                                            with_mass=True, q_label=view.q_label)                              # [b, Hq] x2
        self.err_sum[layer_id] += err.mean(-1).double().sum().cpu()
        self.recall_sum[layer_id] += rec.mean(-1).double().sum()
        self.mass_sum[layer_id] += mass.mean(-1).double().sum()
        if self.per_row is not None:
            self.per_row.setdefault(layer_id, []).append((rows.cpu(), rec.mean(-1), mass.mean(-1)))
        self.count[layer_id] += rows.numel()

    def means(self):
        """Per layer ``(recall, rel_err)`` means (NaN where nothing was observed)."""
        return self._mean(self.recall_sum), self._mean(self.err_sum)

    def mass_means(self) -> list[float]:
        """Per layer attention mass means (NaN where nothing was observed)."""
        return self._mean(self.mass_sum)

    def _mean(self, total: torch.Tensor) -> list[float]:
        return (total / self.count.clamp_min(1)).masked_fill(self.count == 0, float("nan")).tolist()


def split_windows(ids: list[int], window_len: int, num_windows: int) -> list[list[int]]:
    """``num_windows`` disjoint windows spread over ``ids``; ValueError when the text is short."""
    if len(ids) < window_len * num_windows:
        raise ValueError(f"eval text has {len(ids)} tokens, {num_windows} windows of {window_len} "
                         f"need {window_len * num_windows}")
    slots = len(ids) // window_len
    return [ids[(i * slots // num_windows) * window_len:][:window_len] for i in range(num_windows)]


# two-sided 95 % quantiles of Student's t by degrees of freedom (beyond the table: the normal's)
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23,
        12: 2.18, 15: 2.13, 20: 2.09, 30: 2.04}


def ppl_interval(win_nll: list[float], dense_nll: list[float]) -> list[float]:
    """95 % interval of a setting's perplexity against dense's, in percent, from the paired
    differences of each window's mean NLL (windows of equal length; the windows, not the tokens,
    are taken as independent: tokens of one text are not) -> [low, high]."""
    d = [a - b for a, b in zip(win_nll, dense_nll)]
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    t = _T95[max(k for k in _T95 if k <= n - 1)] if n - 1 <= 30 else 1.96
    half = t * sd / math.sqrt(n)
    return [100 * (math.exp(mean - half) - 1), 100 * (math.exp(mean + half) - 1)]


class TextRunner:
    """Windows prefilled once per K/V cache dtype (dense, shared by every setting of that dtype;
    the model's own when built, another the first time a setting asks for it: driver.PoolSet);
    :meth:`run` scores one setting.

    windows: ``W`` lists of ``window_len`` ids; the first ``window_len - decode_len`` tokens of each
    are prefilled, the next ``decode_len - 1`` are decoded in one forward per group of
    ``batch_windows`` windows (0: all), each predicting its successor. Dense with the model's
    cache runs first (KL and top-1 compare to it); its log-probs ``[rows, V]`` stay on the device.
    impl: kernels' ``impl`` ("auto": Triton on CUDA, PyTorch on CPU); k_rotation: the engine's
    ``--kv-cache-k-rotation`` (driver.PoolSet)."""

    def __init__(self, model, windows, decode_len: int, channels_for, device="cpu", batch_windows: int = 0,
                 impl: str = "auto", k_rotation: str = "auto"):
        wl = len(windows[0])
        if decode_len < 2 or decode_len >= wl:
            raise ValueError(f"decode_len must be in [2, window_len), got {decode_len} for windows of {wl}")
        self.model, self.channels_for, self.device, self.wl = model, channels_for, device, wl
        c = model.config
        self.num_layers = int(c.num_layers)
        prefix = wl - decode_len
        step = batch_windows or len(windows)
        self.groups = []  # (pool set, inputs, targets [rows], dense log-probs or None)
        with torch.inference_mode():
            for g0 in range(0, len(windows), step):
                win = windows[g0:g0 + step]
                pools = driver.PoolSet(model, [w[:prefix] for w in win], wl, device=device, impl=impl,
                                       k_rotation=k_rotation)
                pools.get("auto")
                targets = torch.tensor([t for w in win for t in w[prefix + 1:]], device=device)
                self.groups.append([pools, [w[prefix:-1] for w in win], targets, None])
        self.results: dict[Setting, TextResult] = {}
        self.window_nll: dict[Setting, list[float]] = {}  # per setting, each window's mean NLL

    @torch.inference_mode()
    def run(self, s: Setting, fidelity: FidelityObserver | None = None) -> TextResult:
        """Score ``s`` (dense with the model's cache first if it has not run); with ``fidelity``,
        also per-layer attention fidelity. Results are kept in ``self.results``."""
        if s != DENSE and self.groups[0][3] is None:
            self.run(DENSE)
        a = dict(nll=0.0, kl=0.0, top1=0.0, n=0)
        win_nll: list[float] = []
        k_stats: list = []
        ch = self.channels_for(s) if s.kind == "ds" else None
        for g in self.groups:
            pool_set, inputs, targets, ref = g
            pools = pool_set.get(s.kv)
            if ch is not None:
                pools.relabel(ch, s.label)
            logits = driver.decode_tokens(self.model, pools, s, ch, inputs, s.k_for(self.wl),
                                          observer=fidelity if s.kind == "ds" else None, k_stats=k_stats)
            logp = logits.log_softmax(-1)
            del logits
            tok = -logp.gather(1, targets[:, None]).double()
            win_nll += tok.view(len(inputs), -1).mean(1).tolist()   # the windows' scored tokens, in order
            a["nll"] += float(tok.sum())
            a["n"] += targets.numel()
            if s == DENSE:
                g[3] = ref = logp
            a["kl"] += float((ref.exp() * (ref - logp)).sum())
            a["top1"] += float((ref.argmax(-1) == logp.argmax(-1)).sum())
        n = max(a["n"], 1)
        nll = a["nll"] / n
        res = TextResult(s, ppl=float(torch.tensor(nll).exp()), nll=nll, kl=a["kl"] / n,
                         top1=a["top1"] / n, tokens=a["n"])
        self.window_nll[s] = win_nll
        if s != DENSE and len(win_nll) > 1:
            res.extra["ppl_pct_ci95"] = ppl_interval(win_nll, self.window_nll[DENSE])
        k_rows = sum(float(r) for _, r in k_stats)
        if s.kind == "ds" and k_rows:
            # tokens attended per selection row and layer, where the request decoded sparsely
            res.extra["avg_k"] = sum(float(t) for t, _ in k_stats) / k_rows
        if fidelity is not None and s.kind == "ds":
            res.recall, res.rel_err = fidelity.means()
            res.mass = fidelity.mass_means()
        elif s in self.results:  # keep fidelity measured by an earlier run of the same setting
            old = self.results[s]
            res.recall, res.rel_err, res.mass = old.recall, old.rel_err, old.mass
        self.results[s] = res
        return res


@torch.inference_mode()
def evaluate_text(model, windows: list[list[int]], decode_len: int, settings: list[Setting],
                  channels_for, device="cpu", fidelity: bool = False, batch_windows: int = 0,
                  progress: bool = True, fidelity_stride: int = 1, k_rotation: str = "auto") -> list[TextResult]:
    """Score ``settings`` on ``windows`` (see :class:`TextRunner`). ``channels_for(setting) ->
    [L, Hkv, r]``. Each group of ``batch_windows`` windows is prefilled once for all settings."""
    runner = TextRunner(model, windows, decode_len, channels_for, device, batch_windows, k_rotation=k_rotation)
    chunk = 256 if torch.device(device).type == "cuda" else 64
    for s in tqdm(settings, desc="eval text", unit="setting", disable=not progress):
        obs = FidelityObserver(runner.num_layers, fidelity_stride, chunk) if fidelity and s.kind == "ds" else None
        runner.run(s, obs)
    return [runner.results[s] for s in settings]
