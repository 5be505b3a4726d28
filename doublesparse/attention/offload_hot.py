"""The device hot set of an offloaded Double Sparsity decode: per request row, per layer and per
KV head, ``capacity`` device rows of K and V holding host-store tokens, replaced least recently
used.

Layout (per layer):
    k[layer], v[layer] : [regions * capacity, Hkv, D]   the K/V pools' dtype (device; fp8 rows
                                                         hold what the host store holds)
        region q (= request row q of req_to_token) owns rows q*capacity .. (q+1)*capacity - 1;
        head h of row q*capacity + c holds the token ``tags[layer][q, h, c]`` (a KV slot), so the
        heads of one row are independent (each KV head selects its own tokens)
    tags[layer]  : [regions, Hkv, capacity + 1] int64   slot held (-1: empty); column
                   ``capacity`` is a write sink for masked updates
    stamp[layer] : [regions, Hkv, capacity + 1] int32   step of last use (-1: never)
    where[layer] : [num_slots, Hkv] int32   slot -> hot column of its request, a hint only:
                   it counts as a hit only when ``tags`` agrees, so stale entries (an evicted
                   token, a slot reused after its request ended) can never be read
Everything is updated with fixed-shape device ops and masks: no host sync, no data-dependent
size, so a decode step stays capturable in a CUDA graph.
"""

from __future__ import annotations

import torch


class HotSet:
    """regions: request rows (max_reqs + 1, row 0 being the padding row); capacity: rows per
    (region, layer, head), at least the largest top-k; num_slots: the slot space of the host
    store (and of the label pool)."""

    def __init__(self, num_layers: int, regions: int, capacity: int, num_kv_heads: int, head_dim: int,
                 num_slots: int, dtype: torch.dtype, device):
        self.capacity = int(capacity)
        self.regions = int(regions)
        self.device = torch.device(device)
        L, C, H = num_layers, self.capacity, num_kv_heads
        kw = dict(dtype=dtype, device=self.device)
        # zeros: masked attention rows read finite values
        self.k = [torch.zeros(regions * C, H, head_dim, **kw) for _ in range(L)]
        self.v = [torch.zeros(regions * C, H, head_dim, **kw) for _ in range(L)]
        self.tags = [torch.full((regions, H, C + 1), -1, dtype=torch.int64, device=self.device) for _ in range(L)]
        self.stamp = [torch.full((regions, H, C + 1), -1, dtype=torch.int32, device=self.device) for _ in range(L)]
        self.where = [torch.full((num_slots, H), -1, dtype=torch.int32, device=self.device) for _ in range(L)]
        self.clock = torch.zeros((), dtype=torch.int32, device=self.device)
        # hits, misses (K+V row pairs per KV head), decode steps, rows prefetched for a predicted
        # selection, rows fetched from a device tier (of the misses and prefetches): device
        # counters, read by benchmarks
        self.counters = torch.zeros(5, dtype=torch.int64, device=self.device)
        self._heads = torch.arange(H, device=self.device)[None, :, None]

    @property
    def nbytes(self) -> int:
        t = [*self.k, *self.v, *self.tags, *self.stamp, *self.where]
        return sum(x.numel() * x.element_size() for x in t)

    @staticmethod
    def bytes_for(num_layers, regions, capacity, num_kv_heads, head_dim, num_slots, esize) -> int:
        rows = 2 * regions * capacity * num_kv_heads * head_dim * esize
        book = regions * num_kv_heads * (capacity + 1) * (8 + 4) + num_slots * num_kv_heads * 4
        return num_layers * (rows + book)

    def reset_region(self, row: int) -> None:
        """Forget every token of request row ``row`` (its slots are about to be freed or reused)."""
        for t, s in zip(self.tags, self.stamp):
            t[row].fill_(-1)
            s[row].fill_(-1)

    def tick(self) -> None:
        """One decode step begins (stamps order the uses; device op, capturable). The clock moves
        by 2: a prefetch for a predicted selection stamps ``clock - 1``, after every earlier use
        and before this step's true uses, so a fix-up never evicts a row the step needs."""
        self.clock.add_(2)
        self.counters[2].add_(1)

    def lookup(self, layer: int, req_idx: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor,
               reuse: bool = True, predicted: bool = False):
        """Map a step's wanted tokens to hot rows, choosing victims for the misses.

        req_idx: [B] int (device); slots: [B, Hkv, K] int64, the wanted KV slots (K: the widest
        selection); valid: [B, Hkv, K] bool (the first n_b entries of each row). The wanted slots
        of one row must be distinct. Returns ``(hot [B, Hkv, K] int32, rows of self.k/v holding
        each wanted token once the misses are fetched (0 where not valid); fetch [B, Hkv, K] bool,
        the entries to copy from the host)``. ``reuse`` False: nothing is kept across steps (the
        no-reuse peer): every valid entry is fetched into row ``region * capacity + its index``.
        ``predicted``: a prefetch for a guessed selection (stamped just before this step's uses,
        counted apart, its hits not counted).
        """
        C = self.capacity
        valid = valid.expand_as(slots)   # a selection's mask may come per row, [B, 1, K]
        reg = req_idx.long()[:, None, None]
        heads = self._heads
        base = reg * C
        if not reuse:
            idx = torch.arange(slots.shape[2], device=slots.device)[None, None, :]
            hot = torch.where(valid, base + idx, 0).to(torch.int32)
            self.counters[1].add_(valid.sum())
            return hot, valid
        tags, stamp, where = self.tags[layer], self.stamp[layer], self.where[layer]
        col = where[slots, heads].long()                                        # [B, H, K]
        colc = col.clamp(min=0)
        hit = valid & (col >= 0) & (tags[reg, heads, colc] == slots)
        miss = valid & ~hit
        now = self.clock - 1 if predicted else self.clock
        # hits are used now: they sort last, so no victim is taken among them
        stamp.index_put_((reg.expand_as(col), heads.expand_as(col), torch.where(hit, colc, C)), now)
        order = torch.sort(stamp[req_idx.long()][:, :, :C], dim=-1, stable=True).indices  # [B, H, C]
        rank = (miss.to(torch.int32).cumsum(-1) - 1).clamp(min=0).long()
        victim = torch.gather(order, 2, rank.clamp(max=C - 1))                  # [B, H, K]
        put = torch.where(miss, victim, C)
        tags.index_put_((reg.expand_as(put), heads.expand_as(put), put), torch.where(miss, slots, -1))
        stamp.index_put_((reg.expand_as(put), heads.expand_as(put), put), now)
        where.index_put_((torch.where(miss, slots, 0), heads.expand_as(slots)),
                         torch.where(miss, victim, -1).to(torch.int32))
        hot = torch.where(valid, base + torch.where(hit, colc, victim), 0).to(torch.int32)
        if predicted:
            self.counters[3].add_(miss.sum())
        else:
            self.counters[0].add_(hit.sum())
            self.counters[1].add_(miss.sum())
        return hot, miss

    def fetch(self, layer: int, tiers, slots, hot, fetch, impl: str = "auto") -> None:
        """Copy the K/V rows of the ``fetch`` entries from the store (``tiers``: the layer's
        ``HostKVStore.tiers``: host rows, and device-tier rows where there is one) into their hot
        rows (slots, hot, fetch as from :meth:`lookup`)."""
        from ..kernels.host_copy import copy_from_tiers
        heads = self._heads.expand_as(slots)
        if tiers[2] is not None:
            self.counters[4].add_((fetch & (slots <= tiers[4])).sum())
        copy_from_tiers(tiers, self.k[layer], self.v[layer], slots, hot, heads.contiguous(),
                        fetch.contiguous(), impl=impl)

    def stats(self) -> dict:
        """Counters so far (one host sync: call outside the decode loop)."""
        h, m, steps, pre, dev = (int(x) for x in self.counters.tolist())
        return {"hits": h, "misses": m, "steps": steps, "prefetched": pre, "device_fetched": dev}
