"""Mamba-2 flavors: the state-spaces/mamba2-{130m,370m,780m,1.3b,2.7b} shapes (mamba_ssm's MambaConfig with
ssm_cfg layer "Mamba2": d_state 128, d_conv 4, expand 2, headdim 64, ngroups 1, chunk 256, RMSNorm eps 1e-5; d_model
and n_layer per size). Widths and depths follow mamba_ssm's published configs as recalled, not checked against the
hub files here; the vocabulary (GPT-NeoX's 50277 padded to a multiple of 16: 50288) is unverified. The published
models tie the output to the embedding; titanlike never ties (models/nemotron_h/hf.py copies it on import)."""
from __future__ import annotations

from models.mamba2.args import Mamba2Args


def _size(dim: int, n_layers: int) -> Mamba2Args:
    return Mamba2Args(dim=dim, n_layers=n_layers, mamba_n_heads=2 * dim // 64)


mamba2_flavors: dict[str, Mamba2Args] = {
    # Tiny, for CPU tests and smoke runs (vocab_size comes from the tokenizer).
    "debugmodel": Mamba2Args(dim=128, n_layers=4, vocab_size=2048, mamba_n_heads=8, mamba_head_dim=32,
                             ssm_state_size=16, n_groups=2, chunk_size=32),
    "130m": _size(768, 24),
    "370m": _size(1024, 48),
    "780m": _size(1536, 48),
    "1.3b": _size(2048, 48),
    "2.7b": _size(2560, 64),
}
