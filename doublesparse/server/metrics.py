"""Prometheus metrics.

Latency histograms and token counters are updated by the HTTP handlers as events arrive (so rates
are live, not only at request end). Engine-side state (running/waiting, KV pool, sparse decode
share) is read from the worker's last ``engine.stats()`` snapshot at scrape time, so a scrape never
touches the engine itself. Each server has its own registry, so several apps can live in one
process (tests) without duplicate-metric errors.
"""

from __future__ import annotations

import sys

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client import disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from .host_heap import malloc_info

disable_created_metrics()  # the *_created series only add noise to every scrape
P = "doublesparse_"
# Latency buckets: sub-ms fake-engine steps up to minutes-long CPU generations.
_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

# Candidate key names in engine.stats(): the first present wins, so small naming differences in
# the engine do not silently zero a metric.
STAT_KEYS = {
    "running": ("running", "num_running", "num_running_reqs"),
    "waiting": ("waiting", "num_waiting", "num_waiting_reqs", "queued"),
    "kv_used": ("kv_used_tokens", "kv_pool_used_tokens", "kv_used", "token_usage_tokens",
                "used_tokens"),
    "kv_total": ("kv_total_tokens", "kv_pool_total_tokens", "kv_total", "max_total_tokens",
                 "total_tokens"),
    "decode_steps": ("decode_steps_total", "decode_steps", "num_decode_steps"),
    "sparse_steps": ("decode_steps_sparse", "sparse_decode_steps", "decode_steps_sparse_total",
                     "num_sparse_decode_steps"),
    "kv_cached": ("kv_cached_tokens",),
    "cache_hit": ("prefix_cache_hit_tokens",),
    "cache_query": ("prefix_cache_query_tokens",),
    "cache_evicted": ("prefix_cache_evicted_tokens",),
}


def stat(snap: dict, name: str, default: float = 0.0) -> float:
    for k in STAT_KEYS[name]:
        v = snap.get(k)
        if isinstance(v, (int, float)):
            return float(v)
    return default


class _EngineCollector:
    def __init__(self, worker) -> None:
        self.worker = worker

    def collect(self):
        s = self.worker.snapshot
        used, total = stat(s, "kv_used"), stat(s, "kv_total")
        steps, sparse = stat(s, "decode_steps"), stat(s, "sparse_steps")
        hit, query = stat(s, "cache_hit"), stat(s, "cache_query")
        for name, doc, v in (
            ("num_requests_running", "Requests in the running batch", stat(s, "running")),
            ("num_requests_waiting", "Requests queued in the engine (e.g. KV pool full)",
             stat(s, "waiting")),
            ("kv_pool_used_tokens", "KV pool token slots in use", used),
            ("kv_pool_total_tokens", "KV pool token slots in total", total),
            ("kv_pool_usage", "Fraction of KV pool slots in use", used / total if total else 0.0),
            ("sparse_decode_ratio", "Share of decode steps run with sparse attention",
             sparse / steps if steps else 0.0),
            ("kv_pool_cached_tokens", "KV pool token slots held by the prefix cache (those no "
             "running request uses count as free)", stat(s, "kv_cached")),
            ("prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens "
             "admitted, since start", hit / query if query else 0.0),
        ):
            g = GaugeMetricFamily(P + name, doc)
            g.add_metric([], v)
            yield g
        if "double_sparsity" in s:
            info = GaugeMetricFamily(P + "decode_mode", "How decode runs (1 on the series whose "
                                     "labels describe it)", labels=["double_sparsity", "policy",
                                                                    "heavy_token_num",
                                                                    "heavy_channel_num",
                                                                    "channel_source"])
            info.add_metric([str(bool(s["double_sparsity"])).lower(), str(s.get("decode_policy")),
                             str(s.get("heavy_token_num")),
                             str(s.get("heavy_channel_num")), str(s.get("channel_source"))], 1.0)
            yield info
        for name, doc, v in (("decode_steps", "Decode steps run by the engine", steps),
                             ("sparse_decode_steps", "Decode steps run with sparse attention", sparse),
                             ("prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache "
                              "(not computed again)", hit),
                             ("prefix_cache_query_tokens", "Prompt tokens of admitted requests "
                              "(the hit rate's denominator)", query),
                             ("prefix_cache_evicted_tokens", "Cached tokens evicted to make room "
                              "for new requests", stat(s, "cache_evicted")),
                             ("engine_step_failures", "Engine steps that raised; the requests they "
                              "held ended with an error and serving went on",
                              float(self.worker.step_errors))):
            c = CounterMetricFamily(P + name, doc)
            c.add_metric([], v)
            yield c
        if s.get("attention_recall"):
            yield from recall_metrics(s["attention_recall"])
        if s.get("budget_scale"):
            yield from budget_scale_metrics(s["budget_scale"])


def budget_scale_metrics(b: dict):
    """The adaptive budget (attention/adaptive.py): each layer group's mean scale of the token
    budget, the target recall and the scale changes since start."""
    g = GaugeMetricFamily(P + "ds_budget_scale", "Mean scale of the token budget over the layers "
                          "of the group (adaptive budget mode; 1: the ratio budget)", labels=["layer_group"])
    for grp in b["groups"]:
        g.add_metric([grp["layers"]], float(grp["scale"]))
    yield g
    t = GaugeMetricFamily(P + "ds_target_recall", "Sampled attention recall the adaptive budget aims at")
    t.add_metric([], float(b["target_recall"]))
    yield t
    c = CounterMetricFamily(P + "ds_budget_scale_changes", "Changes of a layer's budget scale since start")
    c.add_metric([], float(b["changes"]))
    yield c


def recall_metrics(r: dict):
    """The sampled attention recall (attention/recall.py; docs/serving-metrics.md): a histogram
    per layer group of the share of the exact attention mass each sampled (request, layer)
    selection captured, and the model's mean, minimum and output relative error."""
    h = HistogramMetricFamily(P + "ds_attention_recall", "Share of the exact attention mass the "
                              "sparse selection captured, per sampled request and layer",
                              labels=["layer_group"])
    for g in r["groups"]:
        edges = [f"{e:g}" for e in g["buckets"]] + ["+Inf"]
        h.add_metric([g["layers"]], list(zip(edges, g["cumulative_counts"])), g["sum"])
    yield h
    for name, key, doc in (
            ("ds_attention_recall_mean", "recall_mean", "Mean sampled attention recall over all layers"),
            ("ds_attention_recall_min", "recall_min", "Lowest sampled attention recall"),
            ("ds_attention_output_rel_error", "rel_error_mean", "Mean relative error of the sampled "
             "layers' attention output against exact attention")):
        if r.get(key) is not None:
            g = GaugeMetricFamily(P + name, doc)
            g.add_metric([], float(r[key]))
            yield g


def _compiled_triton_kernels() -> int | None:
    """Compiled variants held by the package's Triton kernels (each new specialization adds one)."""
    try:
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction
    except ImportError:
        return None
    n = 0
    for name, mod in list(sys.modules.items()):
        if not name.startswith("doublesparse.kernels") or mod is None:
            continue
        for obj in list(vars(mod).values()):
            fn = obj.fn if isinstance(obj, Autotuner) else obj
            if isinstance(fn, JITFunction):
                n += sum(len(c[0]) for c in getattr(fn, "device_caches", {}).values())
    return n


class _RuntimeCollector:
    """What can grow a GPU server's resident memory besides Python objects: torch's page-locked
    host pool (it keeps every block it ever handed out), compiled Triton variants, and glibc's
    heap (in use against free-but-kept: fragmentation). A soak reads them beside the process RSS
    to tell which one grows."""

    def collect(self):
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            st = torch.cuda.host_memory_stats()
            # the key names moved between torch releases: bytes the pool owns (cached included)
            owned = next((st[k] for k in ("allocated_bytes.current", "reserved_bytes.current") if k in st), None)
            if owned is not None:
                g = GaugeMetricFamily(P + "host_pinned_bytes", "Page-locked host memory torch's pool owns")
                g.add_metric([], float(owned))
                yield g
            g = GaugeMetricFamily(P + "cuda_memory_reserved_bytes", "torch's CUDA caching allocator: reserved")
            g.add_metric([], float(torch.cuda.memory_reserved()))
            yield g
        n = _compiled_triton_kernels()
        if n is not None:
            g = GaugeMetricFamily(P + "triton_kernels_compiled", "Compiled variants of the package's "
                                  "Triton kernels in this process")
            g.add_metric([], float(n))
            yield g
        heap = malloc_info()
        if heap is not None:
            for key, v in heap.items():
                g = GaugeMetricFamily(P + f"malloc_{key}_bytes", f"glibc heap: {key} (mallinfo2)")
                g.add_metric([], float(v))
                yield g


class ServerMetrics:
    def __init__(self, worker) -> None:
        r = self.registry = CollectorRegistry()
        # process_resident_memory_bytes and friends (Linux): what a soak watches for growth
        ProcessCollector(registry=r)
        self.requests = Counter(P + "requests", "Finished HTTP generation requests",
                                ["endpoint", "status"], registry=r)
        self.rejected = Counter(P + "rejected_requests", "Requests refused with an error body",
                                ["status"], registry=r)
        self.in_flight = Gauge(P + "requests_in_flight", "Generation requests accepted by HTTP",
                               registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of served requests",
                                     registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LAT, registry=r)
        self.tpot = Histogram(P + "time_per_output_token_seconds",
                              "Mean gap between output tokens after the first, per request",
                              buckets=_TPOT, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to last token",
                             buckets=_LAT, registry=r)
        r.register(_EngineCollector(worker))
        r.register(_RuntimeCollector())

    def render(self) -> bytes:
        return generate_latest(self.registry)
