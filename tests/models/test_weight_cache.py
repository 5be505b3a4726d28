"""The converted-weights cache of GGUF models (models/weight_cache.py): a second load reads the
entry instead of the GGUF and gives the same model; stale, damaged or foreign entries are ignored."""

import os

import pytest
import torch
from test_models import _save_random_hf, _write_gguf

from doublesparse.models import load_model, weight_cache, weights

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("DOUBLESPARSE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(weight_cache, "MIN_GGUF_BYTES", 0)  # cache even a tiny file
    path = tmp_path / "tiny.gguf"
    _write_gguf(_save_random_hf("qwen3", tmp_path / "hf"), "qwen3", path)  # tied embeddings
    return path


def _no_gguf_parsing(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("the GGUF was parsed although a cache entry exists")
    monkeypatch.setattr("doublesparse.models.loader.open_gguf", fail)


def test_second_load_reads_the_entry(gguf, monkeypatch):
    first = load_model(gguf, progress=False)
    entry = weight_cache.entry_path(gguf, torch.float32)
    assert entry.is_file()
    _no_gguf_parsing(monkeypatch)
    again = load_model(gguf, progress=False)
    assert again.config == first.config
    a, b = first.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert again.lm_head.weight is again.embed_tokens.weight
    ids = torch.randint(0, first.config.vocab_size, (11,))
    from doublesparse.models import forward_sequence
    torch.testing.assert_close(forward_sequence(again, ids), forward_sequence(first, ids), rtol=0, atol=0)


def test_damaged_or_stale_entries_are_rebuilt(gguf, monkeypatch):
    load_model(gguf, progress=False)
    entry = weight_cache.entry_path(gguf, torch.float32)
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])     # truncated
    calls = []
    real = weights.load_gguf_weights
    monkeypatch.setattr("doublesparse.models.loader.load_gguf_weights",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    load_model(gguf, progress=False)
    assert calls == [1] and entry.stat().st_size > 0
    load_model(gguf, progress=False)
    assert calls == [1]                                                     # rebuilt entry is used
    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))             # the GGUF changed
    assert weight_cache.entry_path(gguf, torch.float32) != entry
    load_model(gguf, progress=False)
    assert calls == [1, 1] and not entry.exists()                           # the stale one is gone
    load_model(gguf, progress=False, weight_cache=False)
    assert calls == [1, 1, 1]


def test_packed_copies_are_cached(gguf, monkeypatch):
    from doublesparse.models import packed

    first = load_model(gguf, progress=False, packed=True)
    assert weight_cache.packed_entry_path(gguf, torch.float32).is_file()
    kinds = {n: m.packed.kind for n, m in first.named_modules() if getattr(m, "packed", None) is not None}
    assert kinds and "lm_head" in kinds
    _no_gguf_parsing(monkeypatch)
    monkeypatch.setattr(packed, "pack_linears", lambda m: pytest.fail("packed again although cached"))
    again = load_model(gguf, progress=False, packed=True)
    for n, m in again.named_modules():
        if n in kinds:
            p, q = m.packed, dict(first.named_modules())[n].packed
            assert p.kind == q.kind and torch.equal(p.data, q.data) and torch.equal(p.scales, q.scales)
    assert all(getattr(m, "packed", None) is None for m in load_model(gguf, progress=False).modules())
