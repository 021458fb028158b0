"""Mamba-2 language model arguments (HF Mamba2ForCausalLM, state-spaces/mamba2-*): every layer a Mamba-2 mixer. The
fields are models/nemotron_h/args.py's HybridArgs (the shared skeleton); the defaults are mamba2-130m's."""
from __future__ import annotations

from dataclasses import dataclass

from models.nemotron_h.args import HybridArgs


@dataclass
class Mamba2Args(HybridArgs):
    """Mamba2 clamps softplus(dt + dt_bias) to dt_limit (time_step_limit; (0, inf) in the published models) and
    normalises y * silu(z) in n_groups groups, as NemotronH does."""

    dim: int = 768
    n_layers: int = 24
    vocab_size: int = 50288
    mamba_n_heads: int = 24  # expand 2: 2 x dim / head_dim
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 1
    chunk_size: int = 256
