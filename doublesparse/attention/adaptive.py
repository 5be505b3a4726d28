"""The adaptive budget (``--ds-budget-mode adaptive``): per-layer scales of the ratio budget that
follow the sampled attention recall.

The host plans each request's k as the ratio budget does (attention/budget.py). Each layer then
attends to ``clamp(round(k x scale[layer]), k_lo, k_max)`` tokens (rows the plan decodes densely
stay dense; a row whose scaled k reaches its length decodes densely at that layer, inside the same
launches), where ``k_max`` is the workspace's largest k, sized for the largest scale
(``EngineConfig.token_budget``), and ``k_lo`` is the ratio budget's floor times the smallest
scale (at least the forced sink + recent tokens): below the floor the measured recall, not the
floor's guess, says what a layer needs. The scales move on the host (attention/adaptive_control.py) from
the samples of the recall probe (attention/recall.py) and reach the device as one async copy of
``[num_layers]`` float32 between steps, only when one changed.

How it stays off the decode path:

* :meth:`AdaptiveBudget.attach` wraps the backend's ``plan`` and ``decode_attention`` (no branch
  in the backend). The plan hands layer i the k of row i of a ``[L, max_reqs]`` int32 device
  buffer; at layer 0 of a sparse step the wrapped ``decode_attention`` fills that buffer from the
  step's k and the device scales (a few elementwise launches per step, captured in the CUDA
  graphs, so a replay reads the scales in force). The host never reads them: the probe gets the
  same numbers from the host's copy of the scales (:meth:`host_ks`, the same float32 arithmetic).
* The runner's ``decode`` is wrapped to fold the probe's landed samples into the controller after
  a step (an event query, never a wait).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..kernels.transfer import to_device
from .adaptive_control import AdaptiveConfig, BudgetController
from .budget import DENSE


def selected_bytes(plan, modes: tuple[str, ...], num_q_heads: int) -> list[int]:
    """Per layer: the K/V bytes one selected token costs that layer's decode of one row (its
    mode decides how many rows of K/V a selection reads)."""
    out = []
    for mode in modes:
        rows = num_q_heads if mode == "per_head" else (1 if mode == "layer" else plan.num_kv_heads)
        out.append((1 if plan.latent else 2) * rows * plan.head_dim * plan.kv_dtype.itemsize)
    return out


def cost_caps(plan, modes: tuple[str, ...], num_q_heads: int, ratio: float) -> list[float]:
    """Per layer: the scale of a ratio budget from which that layer's sparse decode reads at least
    what its dense decode reads (labels of every token + K/V of ``ratio x scale x n`` selected
    rows against K/V of all n tokens): ``(kv - label) / (selected x ratio)`` per token."""
    L = plan.num_layers
    kv = plan.kv_bytes_per_token / L
    label = plan.label_bytes_per_token / L
    return [(kv - label) / (sel * ratio) if ratio > 0 else float("inf")
            for sel in selected_bytes(plan, modes, num_q_heads)]


class AdaptiveBudget:
    """One Double Sparsity backend's per-layer budget scales (see the module docstring).

    cfg: the controller's settings; backend: a DoubleSparsityBackend whose policy is a ratio
    budget; probe: its :class:`~.recall.RecallProbe`; max_scales: each layer's upper bound (the
    cost caps; ``cfg.max_scale`` applies on top)."""

    def __init__(self, cfg: AdaptiveConfig, backend, probe, max_scales: list[float]):
        self.backend, self.probe = backend, probe
        self.ctl = BudgetController(cfg, max_scales)
        budget, ds = backend.ds.policy.budget, backend.ds
        self.k_min, self.k_max = budget.k_min, ds.k_max
        self.k_lo = min(self.k_max, max(1, ds.num_sink + ds.num_recent, math.ceil(budget.k_min * cfg.min_scale)))
        dev = backend.memory.label[0].device
        self.host = torch.tensor(self.ctl.scales, dtype=torch.float32)    # [L]: the host's copy
        self.scale = self.host.to(dev)                                    # [L] float32, read in the graphs
        self.pushes = 0
        L = self.ctl.num_layers
        self._src = None
        self._k = None  # [L, max_reqs] int32: each layer's k of the step (made on the first plan)
        self._seen = [(0, 0.0)] * L                                       # per layer: (samples, sum) folded
        self._sampled = -1

    # ------------------------------------------------------------------------- wiring
    def attach(self, backend) -> None:
        """Wrap ``backend.plan`` and ``backend.decode_attention`` (before any graph capture) and
        its ``decode_bytes``; give the probe the per-layer ks."""
        inner_plan, inner = backend.plan, backend.decode_attention

        def plan(batch):
            inner_plan(batch)
            if batch.mode == "decode" and batch.attn_meta is not None and batch.k is not None:
                if self._k is None:  # made outside any graph capture: plans run before them
                    self._k = torch.empty(len(batch.attn_meta), backend.memory.plan.max_reqs,
                                          dtype=torch.int32, device=batch.k.device)
                B = batch.k.shape[0]
                batch.attn_meta = tuple(dataclasses.replace(a, k=self._k[i, :B])
                                        for i, a in enumerate(batch.attn_meta))

        def decode_attention(layer_id, q, batch, q_label=None):
            k = batch.k
            # a sparse step the plan above saw: fill the rows its args read, at its first layer
            if batch.attn_meta is not None and k is not None and (layer_id == 0 or self._src is not k):
                self._src = k
                self._k[:, :k.shape[0]] = self.layer_ks(k)
            return inner(layer_id, q, batch, q_label=q_label)

        backend.plan = plan
        backend.decode_attention = decode_attention
        backend.decode_bytes = self.decode_bytes
        self.probe.scale_k = self.host_ks

    def attach_runner(self, runner) -> None:
        inner = runner.decode

        def decode(rows, tokens, positions, plan=None):
            logits = inner(rows, tokens, positions, plan)
            self.update()
            return logits

        runner.decode = decode

    # --------------------------------------------------------------------------- device
    def layer_ks(self, ks: torch.Tensor) -> torch.Tensor:
        """ks ``[B]`` int32 (DENSE: a dense row) -> every layer's ``[L, B]`` int32 on ks' device."""
        k = (ks.float()[None, :] * self.scale[:, None]).round_().clamp_(self.k_lo, self.k_max)
        return torch.where(ks[None, :] == DENSE, ks[None, :], k.to(torch.int32))

    def host_ks(self, layer: int, ks: list[int]) -> list[int]:
        """What :meth:`layer_ks` gives layer ``layer`` for the sparse rows' ``ks``, from the host's
        copy of the scales (the same float32 arithmetic)."""
        t = torch.tensor(ks, dtype=torch.int32).float() * self.host[layer]
        return t.round_().clamp_(self.k_lo, self.k_max).to(torch.int32).tolist()

    def _push(self) -> None:
        self.host = torch.tensor(self.ctl.scales, dtype=torch.float32)
        # stream-ordered after the step just launched and before the next one's launches
        self.scale.copy_(to_device(self.host, self.scale.device), non_blocking=True)
        self.pushes += 1

    # ----------------------------------------------------------------------------- host
    def update(self) -> bool:
        """Fold the probe's samples that have landed into the controller; push the scales when
        one changed. Returns whether they changed."""
        p = self.probe
        if p.sampled_steps == self._sampled and not p.pending:
            return False
        self._sampled = p.sampled_steps
        p.collect()
        changed = False
        for layer, t in enumerate(p.stats.layers):
            n0, s0 = self._seen[layer]
            if t.count > n0:
                self._seen[layer] = (t.count, t.recall_sum)
                changed |= self.ctl.add_mean(layer, (t.recall_sum - s0) / (t.count - n0), t.count - n0)
        if changed:
            self._push()
        return changed

    def decode_bytes(self, seq_lens_host) -> int:
        """The backend's ``decode_bytes`` with each layer's scaled k: labels of every token + K/V
        of the selected ones where a row decodes sparsely at that layer, else its K/V."""
        b = self.backend
        p = b.memory.plan
        L = p.num_layers
        kv, label = p.kv_bytes_per_token // L, p.label_bytes_per_token // L
        lens = list(seq_lens_host)
        ks = b.decode_plan(lens)[0]
        sparse = [i for i, k in enumerate(ks) if k != DENSE]
        total = sum(n * kv * L for n, k in zip(lens, ks) if k == DENSE)
        sels = selected_bytes(p, tuple(b.ds.mode_of(i) for i in range(L)), b.num_q_heads)
        for layer, sel in enumerate(sels):
            kl = self.host_ks(layer, [ks[i] for i in sparse]) if sparse else []
            for i, k in zip(sparse, kl):
                n = lens[i]
                total += n * label + k * sel if n > k else n * kv
        return total

    def summary(self) -> dict:
        """The controller's state, each layer group's mean scale, the bounds of every layer's k."""
        s = self.ctl.summary()
        st = self.probe.stats
        s["groups"] = [{"layers": st.group_name(g), "scale": sum(s["scales"][a:b + 1]) / (b - a + 1)}
                       for g, (a, b) in enumerate(st.groups)]
        s["k_min"], s["k_lo"], s["k_max"] = self.k_min, self.k_lo, self.k_max
        s["window"] = self.ctl.cfg.window
        return s


def build(cfg: AdaptiveConfig, backend, probe, plan, num_q_heads: int) -> AdaptiveBudget:
    """The adaptive budget of ``backend``, attached (call before the runner captures its graphs);
    attach the runner with :meth:`AdaptiveBudget.attach_runner` once it exists."""
    ds = backend.ds
    modes = tuple(ds.mode_of(i) for i in range(plan.num_layers))
    caps = cost_caps(plan, modes, num_q_heads, ds.policy.budget.ratio)
    a = AdaptiveBudget(cfg, backend, probe, caps)
    a.attach(backend)
    return a
