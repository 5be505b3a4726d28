"""The evaluation driver's KV and label pools (:mod:`.driver`), in the kernels' layout, with the
K/V cache dtype of a setting (the engine's ``--kv-cache-dtype``)."""

from __future__ import annotations

import torch

from doublesparse.attention.base import as_cached
from doublesparse.attention.k_rotation import rotate
from doublesparse.engine.memory import KV_CACHE_TORCH_DTYPES, LABEL_TORCH_DTYPES
from doublesparse.kernels import ops
from doublesparse.kernels.reference import dequant_kv, is_fp8_kv
from doublesparse.kernels.workspace import DecodeWorkspace


class Pools:
    """KV and label pools in the kernels' layout for ``num_reqs`` requests of up to ``max_ctx``.

    k[l], v[l]: ``[S, Hkv, D]`` in ``dtype``, or as ``kv_cache_dtype`` says ("bf16", "fp8_e4m3",
    "fp8_e5m2"; "auto": ``dtype``); fp8 pools store ``x / scale`` with ``k_scale = v_scale = 1.0``
    ([1] float32: the engine's default for a checkpoint without scales); fp8 or rotated pools keep
    the prefix's unquantized, unrotated K in ``k_src[l]`` (``dtype``), the source of its labels, as
    the engine takes a label from the unquantized, unrotated k; labels[(r, label)][l]:
    ``[S, Hkv, r]`` bf16 or fp8 e4m3 (one pool per r and label dtype in use; fp8 with scale 1, as
    the engine stores them); k_rotation: None, or R ``[L, Hkv, D, D]`` (attention/k_rotation.py,
    the engine's ``--kv-cache-k-rotation``): the backends rotate q and k by it before the K/V
    pools store or attention reads them, while the labels and the label scores keep the
    unrotated K and q;
    req_to_token: ``[num_reqs + 1, max_ctx]`` int32. Slot 0 and row 0 are padding; request i owns
    row i + 1 and slots ``1 + i * max_ctx + position``.
    """

    def __init__(self, config, num_reqs: int, max_ctx: int, device="cpu", dtype=torch.float32,
                 impl: str = "auto", kv_cache_dtype: str = "auto", k_rotation: torch.Tensor | None = None):
        c = config
        self.impl = impl  # passed to every ops call: "auto" = Triton on CUDA, reference on CPU
        self.L, self.hq, self.hkv, self.D = int(c.num_layers), int(c.num_q_heads), int(c.num_kv_heads), int(c.head_dim)
        self.max_ctx, self.device = max_ctx, torch.device(device)
        self.kv_cache_dtype = kv_cache_dtype
        self.k_rotation = None if k_rotation is None else k_rotation.to(device, dtype)
        kv_dtype = KV_CACHE_TORCH_DTYPES.get(kv_cache_dtype, dtype)
        S = 1 + num_reqs * max_ctx
        self.k = [torch.zeros(S, self.hkv, self.D, dtype=kv_dtype, device=device) for _ in range(self.L)]
        self.v = [torch.zeros_like(self.k[0]) for _ in range(self.L)]
        self.k_src = ([torch.zeros(S, self.hkv, self.D, dtype=dtype, device=device) for _ in range(self.L)]
                      if is_fp8_kv(kv_dtype) or k_rotation is not None else None)
        self.k_scale = torch.ones(1, dtype=torch.float32, device=device)
        self.v_scale = torch.ones(1, dtype=torch.float32, device=device)
        self.labels: dict[tuple, list[torch.Tensor]] = {}
        self.label_scale = torch.ones(1, dtype=torch.float32, device=device)
        base = 1 + torch.arange(num_reqs, device=device)[:, None] * max_ctx
        r2t = base + torch.arange(max_ctx, device=device)[None]
        self.req_to_token = torch.cat([torch.zeros(1, max_ctx, dtype=torch.long, device=device), r2t]).int()
        self.prefix_len = [0] * num_reqs
        self._ws: dict = {}
        self._labelled: dict[tuple, tuple] = {}  # (r, label) -> (channels, prefix_len) the prefix labels hold

    @property
    def scales(self) -> dict:
        """The ``k_scale`` / ``v_scale`` keyword arguments of the ops (read for fp8 pools only)."""
        return dict(k_scale=self.k_scale, v_scale=self.v_scale)

    def rotate(self, layer_id: int, q, k):
        """(q, k) as the backends use them: rotated by layer ``layer_id``'s R, or unchanged."""
        if self.k_rotation is None:
            return q, k
        return rotate(q, k, self.k_rotation[layer_id])

    def as_read(self, k, v):
        """This chunk's k, v ``[T, Hkv, D]`` as the pools hold them, in their own dtype: what the
        engine's prefill attends to (attention/base.py ``as_cached``; unchanged in the model's
        dtype)."""
        if self.k[0].dtype == k.dtype:
            return k, v
        return (as_cached(k, self.k[0].dtype, self.k_scale, k.dtype),
                as_cached(v, self.v[0].dtype, self.v_scale, v.dtype))

    def slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.req_to_token[rows.long(), positions.long()]

    def label_pool(self, r: int, label: str = "bf16") -> list[torch.Tensor]:
        """Per layer, the ``[S, Hkv, r]`` label pool of dtype ``label`` ("bf16" or "fp8")."""
        key = (r, label)
        if key not in self.labels:
            S = self.k[0].shape[0]
            self.labels[key] = [torch.zeros(S, self.hkv, r, dtype=LABEL_TORCH_DTYPES[label], device=self.device)
                                for _ in range(self.L)]
        return self.labels[key]

    def relabel(self, channels: torch.Tensor, label: str = "bf16") -> None:
        """Labels of every request's prefix from its stored K, through the real store kernel.

        channels: ``[L, Hkv, r]``; label: the pool's dtype ("bf16" or "fp8"). Skipped when that
        (r, label) pool's prefix already holds labels of the same channels: decoding only ever
        rewrites slots after the prefix, and each decode forward stores its own tokens' labels
        before it reads them. fp8 pools: the labels come from ``k_src``, and the store rewrites
        the same fp8 K (quantized from ``k_src`` again) and V (at scale 1.0 its values are exact
        in float32, so quantizing them again gives the same bits)."""
        key = (channels.shape[-1], label)
        pool = self.label_pool(*key)
        done = self._labelled.get(key)
        if (done is not None and done[1] == tuple(self.prefix_len) and done[0].shape == channels.shape
                and torch.equal(done[0], channels.cpu())):
            return
        self._labelled[key] = (channels.cpu().clone(), tuple(self.prefix_len))
        slots = torch.cat([self.req_to_token[i + 1, :n] for i, n in enumerate(self.prefix_len) if n])
        idx = slots.long()
        for l in range(self.L):
            k, v = self.k[l][idx], self.v[l][idx]
            k_label = None if self.k_src is None else self.k_src[l][idx]
            if k_label is not None:
                k = dequant_kv(k, self.k_scale).to(k_label.dtype)
                v = dequant_kv(v, self.v_scale).to(k_label.dtype)
            ops.store_kv(self.k[l], self.v[l], k, v, slots, pool[l], self.label_scale,
                         channels[l].to(self.device, torch.int32), **self.scales, impl=self.impl, k_label=k_label)

    def workspace(self, batch: int, k_max: int):
        if self.impl == "torch" or (self.impl == "auto" and self.device.type != "cuda"):
            return None  # the reference path needs no scratch
        key = (batch, k_max)
        if key not in self._ws:
            self._ws[key] = DecodeWorkspace(batch, self.hq, self.hkv, self.D, self.max_ctx, k_max, self.device)
        return self._ws[key]
