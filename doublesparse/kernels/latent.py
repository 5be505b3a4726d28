"""How the CUDA decode kernels split an MLA latent row (kernels/triton/latent_attn.py), without
importing Triton: the model checks its layout against it."""

from __future__ import annotations


def latent_split(D: int) -> tuple[int, int] | None:
    """(DN, DR) with D = DN + DR, both powers of two, DR >= 16 (tl.dot's minimum), DN the larger;
    None when D has no such split (the generic kernel then attends over the full width)."""
    dn = 1 << (D.bit_length() - 1)
    dr = D - dn
    if dr < 16 or dr & (dr - 1):
        return None
    return dn, dr


def latent_value_dim(D: int) -> int:
    """Columns of a latent pool's decode output that hold exact attention values on CUDA: DN of
    :func:`latent_split`, or all D where the generic kernel runs."""
    split = latent_split(D)
    return D if split is None else split[0]


# MLA's one-launch steps around attention (triton/mla_proj.py) take steps of at most this many
# tokens (decode); the model runs larger ones (prefill chunks) through its batched GEMMs.
MLA_PROJ_MAX_TOKENS = 256

