"""Filling a built model with weights: HF safetensors, GGUF (dequantized), or seeded random ("dummy").

:mod:`.loader` builds the model uninitialised on the target device and dtype; these functions then
fill it in place one tensor at a time, so the host never holds a second full copy of the model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .config import ModelConfig

# llama.cpp tensor names -> HF names ("{i}" is the layer index).
_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def hf_weight_map(config: ModelConfig) -> dict[str, tuple[str, int | None, int | None]]:
    """HF tensor name -> (our parameter name, first row, end row) for every tensor a checkpoint must hold.

    Rows are ``None`` when the HF tensor maps onto the whole parameter; q/k/v and gate/up are
    row ranges of our merged projections.
    """
    c = config
    if c.moe is not None or c.mla is not None:
        from .moe_weights import family_weight_map
        return family_weight_map(c, hf_weight_map)
    m: dict[str, tuple[str, int | None, int | None]] = {
        "model.embed_tokens.weight": ("embed_tokens.weight", None, None),
        "model.norm.weight": ("norm.weight", None, None),
    }
    if not c.tie_word_embeddings:
        m["lm_head.weight"] = ("lm_head.weight", None, None)
    q, kv, inter = c.q_size, c.kv_size, c.intermediate_size
    for i in range(c.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        m[hf + "input_layernorm.weight"] = (ours + "input_norm.weight", None, None)
        m[hf + "post_attention_layernorm.weight"] = (ours + "post_attn_norm.weight", None, None)
        kinds = ("weight", "bias") if c.attention_bias else ("weight",)
        for kind in kinds:
            m[hf + f"self_attn.q_proj.{kind}"] = (ours + f"attn.qkv_proj.{kind}", 0, q)
            m[hf + f"self_attn.k_proj.{kind}"] = (ours + f"attn.qkv_proj.{kind}", q, q + kv)
            m[hf + f"self_attn.v_proj.{kind}"] = (ours + f"attn.qkv_proj.{kind}", q + kv, q + 2 * kv)
        if c.qk_norm:
            m[hf + "self_attn.q_norm.weight"] = (ours + "attn.q_norm.weight", None, None)
            m[hf + "self_attn.k_norm.weight"] = (ours + "attn.k_norm.weight", None, None)
        m[hf + "self_attn.o_proj.weight"] = (ours + "attn.o_proj.weight", None, None)
        m[hf + "mlp.gate_proj.weight"] = (ours + "mlp.gate_up_proj.weight", 0, inter)
        m[hf + "mlp.up_proj.weight"] = (ours + "mlp.gate_up_proj.weight", inter, 2 * inter)
        m[hf + "mlp.down_proj.weight"] = (ours + "mlp.down_proj.weight", None, None)
    return m


def gguf_to_hf_name(name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (None if unknown)."""
    parts = name.split(".")
    key, layer = name, None
    if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
        layer, key = parts[1], ".".join(["blk", "{i}", *parts[2:]])
    hf = _GGUF_TO_HF.get(key)
    return None if hf is None else hf.replace("{i}", layer or "")


def hf_to_gguf_name(hf: str) -> str:
    """Inverse of :func:`gguf_to_hf_name` (returns ``hf`` unchanged if it has no GGUF name)."""
    layer = hf.split(".")[2] if hf.startswith("model.layers.") else ""
    for g, h in _GGUF_TO_HF.items():
        if h.replace("{i}", layer) == hf:
            return g.replace("{i}", layer)
    return hf


class _Filler:
    """Copies source tensors into the model's parameters and checks every expected one arrived."""

    def __init__(self, model, source: str):
        self.model, self.source = model, source
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.targets = hf_weight_map(model.config)
        self.seen: set[str] = set()

    def put(self, hf_name: str, tensor: torch.Tensor, shown_name: str | None = None) -> bool:
        target = self.targets.get(hf_name)
        if target is None:
            return False
        pname, lo, hi = target
        dst = self.params[pname].data
        if lo is not None:
            dst = dst[lo:hi]
        if tuple(tensor.shape) != tuple(dst.shape):
            raise ValueError(f"{self.source}: tensor {shown_name or hf_name} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dst.shape)} for {self.model.config.name}")
        dst.copy_(tensor)
        self.seen.add(hf_name)
        return True

    def check(self, rename=lambda n: n):
        missing = [rename(n) for n in self.targets if n not in self.seen]
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise ValueError(f"{self.source}: missing tensor(s) {', '.join(missing[:5])}{more}")


def _bar(total: int, desc: str, progress: bool):
    return tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr, disable=not progress, leave=False)


# ---- Hugging Face safetensors ---------------------------------------------------------------------

def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: {e}") from e
        files = [folder / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{index} lists {f.name}, which does not exist in {folder}")
        return files
    return sorted(folder.glob("*.safetensors"))


def load_safetensors_weights(model, folder: Path, progress: bool = True) -> None:
    from safetensors import safe_open

    files = _safetensors_files(folder)
    if not files:
        raise ValueError(f"{folder}: no *.safetensors weights found")
    filler = _Filler(model, str(folder))
    with torch.no_grad(), _bar(len(filler.targets), f"loading {folder.name}", progress) as bar:
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt", device="cpu")
            except Exception as e:
                raise ValueError(f"{f} is not a readable safetensors file: {e}") from e
            with handle:
                for name in handle.keys():
                    if name in filler.targets and filler.put(name, handle.get_tensor(name)):
                        bar.update()
    filler.check()


# ---- GGUF -----------------------------------------------------------------------------------------

def check_gguf_magic(path: Path) -> None:
    """Cheap early rejection of non-GGUF files (parsing a real header takes seconds)."""
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF')")


def open_gguf(path: Path):
    """``gguf.GGUFReader`` with its assorted failure modes turned into one clear ``ValueError``."""
    import gguf

    check_gguf_magic(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt?): {type(e).__name__}: {e}") from e
    for t in reader.tensors:
        if t.data.nbytes != t.n_bytes:
            raise ValueError(f"{path} is truncated: tensor {t.name} has {t.data.nbytes} of {t.n_bytes} bytes")
    return reader


def _unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's llama q/k row permutation.

    llama.cpp rotates interleaved pairs (GPT-J style), so the converter reorders each head's rows
    from [first half | second half] to alternating; we restore HF's rotate-half order.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf_rope_freqs(reader):
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            import gguf
            return tuple(gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1).tolist())
    return None


def gguf_config(reader) -> ModelConfig:
    return ModelConfig.from_gguf(reader, rope_freqs=_gguf_rope_freqs(reader))


def gguf_tensor_bytes(t) -> torch.Tensor:
    """A ``gguf.ReaderTensor``'s raw bytes as a writable uint8 tensor ``[..., row_bytes]`` (a copy:
    the reader's arrays are read-only views of the memory map, which torch refuses to wrap)."""
    import numpy as np

    data = t.data
    raw = data.view(np.uint8).reshape(*data.shape[:-1], -1) if data.ndim else data.view(np.uint8)
    return torch.from_numpy(np.array(raw, copy=True))


def load_gguf_weights(model, reader, path: Path, progress: bool = True) -> None:
    """Dequantize every tensor on the model's device (torch kernels for the common block types,
    gguf's numpy reference for the rest: :mod:`.gguf_quants`) and copy it into place, one
    tensor at a time."""
    from .gguf_quants import dequantize

    c = model.config
    device = next(model.parameters()).device
    filler = _Filler(model, str(path))
    with torch.no_grad(), _bar(len(filler.targets), f"loading {path.name}", progress) as bar:
        for t in reader.tensors:
            hf = gguf_to_hf_name(t.name)
            if hf is None or hf not in filler.targets:
                continue
            try:
                w = dequantize(gguf_tensor_bytes(t).to(device), t.tensor_type)
            except Exception as e:
                raise ValueError(f"{path}: cannot dequantize tensor {t.name} ({t.tensor_type.name}): {e}") from e
            if c.architecture in ("llama", "mistral"):
                if ".q_proj." in hf:
                    w = _unpermute_qk(w, c.num_q_heads)
                elif ".k_proj." in hf:
                    w = _unpermute_qk(w, c.num_kv_heads)
            filler.put(hf, w, shown_name=t.name)
            del w
            bar.update()
    filler.check(rename=hf_to_gguf_name)


# ---- dummy ----------------------------------------------------------------------------------------

@torch.no_grad()
def init_dummy_weights(model, seed: int = 0, std: float = 0.02) -> None:
    """Seeded N(0, std) weights and biases, unit norm weights, drawn on the model's own device."""
    if model.device.type == "meta":  # shape-only model (memory planning): nothing to draw
        return
    g = torch.Generator(device=model.device).manual_seed(seed)
    for name, p in model.named_parameters():  # tied weights appear once
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, std, generator=g)
