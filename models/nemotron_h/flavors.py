"""NemotronH flavors: named model sizes (run knobs live in configs/).

Sizes follow Megatron-Bridge's Nemotron-H providers (NemotronHModelProvider{8B,47B,56B}, NemotronNano9Bv2) and HF
NemotronHConfig's defaults (which are the 8B's): vocab 131072, head_dim 128, 8 KV heads, Mamba head_dim 64 (Nano-9B-v2:
80), 8 groups, conv 4, chunk 128, RMSNorm eps 1e-5, no biases but the conv's, untied output. Checked against those
sources, not against the published config.json files themselves. Note the 8B's pattern is
"M-M-M-M*-M-M-M-M-M*-..." (52 letters); "M-M-M-MM-M-M-M*-..." (56) is Nemotron-Nano-9B-v2's.
"""
from __future__ import annotations

import dataclasses

from models.nemotron_h.args import NemotronHArgs

_P8B = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
_P47B = "M-M-M-M-M-M-M-M-M*-M-M-M-M-M-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-M-M---MM---M-M*-M-M-M-M-M-"
_P56B = ("M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-"
         "M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-")
_PNANO9B = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"


def _flavor(pattern: str, **kw) -> NemotronHArgs:
    return NemotronHArgs(n_layers=len(pattern), hybrid_override_pattern=pattern, **kw)


_8b = _flavor(_P8B, dim=4096, hidden_dim=21504, n_heads=32, mamba_n_heads=128, ssm_state_size=128)

nemotron_h_flavors: dict[str, NemotronHArgs] = {
    # Tiny, for CPU tests and smoke runs: every kind of layer, Mamba twice (vocab_size comes from the tokenizer).
    "debugmodel": _flavor("M*M-", dim=128, hidden_dim=256, n_heads=4, n_kv_heads=2, head_dim=32, mamba_n_heads=8,
                          mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=32, vocab_size=2048,
                          max_seq_len=2048),
    "8B": _8b,
    # The 8B's first four layers ("M-M-"): real layer shapes on one GPU; no attention layer among them.
    "8B_4L": dataclasses.replace(_8b, n_layers=4, hybrid_override_pattern=_P8B[:4]),
    # The 8B cut to its first attention layer and the MLP after it ("M-M-M-M*-"): every layer kind at real size.
    "8B_9L": dataclasses.replace(_8b, n_layers=9, hybrid_override_pattern=_P8B[:9]),
    "47B": _flavor(_P47B, dim=8192, hidden_dim=30720, n_heads=64, mamba_n_heads=256, ssm_state_size=256),
    "56B": _flavor(_P56B, dim=8192, hidden_dim=32768, n_heads=64, mamba_n_heads=256, ssm_state_size=256),
    "nano_9b_v2": _flavor(_PNANO9B, dim=4480, hidden_dim=15680, n_heads=40, mamba_n_heads=128, mamba_head_dim=80,
                          ssm_state_size=128),
}
