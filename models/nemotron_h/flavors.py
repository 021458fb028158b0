"""NemotronH flavors: named model sizes (run knobs live in configs/).

Sizes follow Megatron-Bridge's Nemotron-H providers (NemotronHModelProvider{8B,47B,56B}, NemotronNano9Bv2) and HF
NemotronHConfig's defaults (which are the 8B's): vocab 131072, head_dim 128, 8 KV heads, Mamba head_dim 64 (Nano-9B-v2:
80), 8 groups, conv 4, chunk 128, RMSNorm eps 1e-5, no biases but the conv's, untied output. Checked against those
sources, not against the published config.json files themselves. Note the 8B's pattern is
"M-M-M-M*-M-M-M-M-M*-..." (52 letters); "M-M-M-MM-M-M-M*-..." (56) is Nemotron-Nano-9B-v2's.

Nemotron-3-Nano-30B-A3B (HF nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16): Megatron-Bridge's Nemotron3NanoProvider
(52 layers "MEMEM*EMEMEM*...": 23 Mamba-2, 23 MoE, 6 attention; dim 2688, 64 Mamba heads of 64, 32 query and 2 KV
heads of 128; 128 squared-ReLU experts of 1856, top 6, one shared expert of 3712, sigmoid routing with the expert
bias, top-k weights renormalised and scaled by 2.5, no expert groups, no latent projection; the provider's training:
sequence-wise aux loss 1e-4, expert bias on at Megatron's default rate 1e-3). transformers' NemotronHConfig defaults
are NOT this model (they are the 8B's dense shape with 8 experts of 7688). Not checked against the published
config.json. Its counts here: 31.58B parameters, 3.58B active, 3.23B without the input embedding (the technical
report's 31.6B total, 3.2B active).
"""
from __future__ import annotations

import dataclasses

from models.common.moe_args import MoEArgs
from models.nemotron_h.args import NemotronHArgs

_P8B = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
_P47B = "M-M-M-M-M-M-M-M-M*-M-M-M-M-M-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-M-M---MM---M-M*-M-M-M-M-M-"
_P56B = ("M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-"
         "M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-")
_PNANO9B = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"
_PNANO3 = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"


def _nemotron_moe(num_experts: int, top_k: int, hidden_dim: int, shared_hidden_dim: int, **kw) -> MoEArgs:
    """NemotronH's MoE: squared-ReLU experts and one shared expert, DeepSeek-V3's sigmoid routing with the expert
    bias (Megatron --moe-router-enable-expert-bias), renormalised top-k weights, the sequence-wise aux loss."""
    return MoEArgs(num_experts=num_experts, top_k=top_k, hidden_dim=hidden_dim, num_shared_experts=1,
                   shared_hidden_dim=shared_hidden_dim, score_func="sigmoid", route_norm=True, expert_act="relu2",
                   bias_update_rate=1e-3, seq_aux_loss_coeff=1e-4, **kw)


def _flavor(pattern: str, **kw) -> NemotronHArgs:
    return NemotronHArgs(n_layers=len(pattern), hybrid_override_pattern=pattern, **kw)


_nano3 = _flavor(_PNANO3, dim=2688, hidden_dim=1856, n_heads=32, n_kv_heads=2, mamba_n_heads=64, ssm_state_size=128,
                 max_seq_len=262144, moe=_nemotron_moe(128, 6, 1856, 3712, route_scale=2.5))
_8b = _flavor(_P8B, dim=4096, hidden_dim=21504, n_heads=32, mamba_n_heads=128, ssm_state_size=128)

nemotron_h_flavors: dict[str, NemotronHArgs] = {
    # Tiny, for CPU tests and smoke runs: every kind of layer, Mamba twice (vocab_size comes from the tokenizer).
    "debugmodel": _flavor("M*M-", dim=128, hidden_dim=256, n_heads=4, n_kv_heads=2, head_dim=32, mamba_n_heads=8,
                          mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=32, vocab_size=2048,
                          max_seq_len=2048),
    # Tiny with MoE layers ("E"): group-limited routing, a scaling factor and a latent projection exercised.
    "debugmodel_moe": _flavor("ME*E", dim=128, hidden_dim=256, n_heads=4, n_kv_heads=2, head_dim=32, mamba_n_heads=8,
                              mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=32, vocab_size=2048,
                              max_seq_len=2048, moe=_nemotron_moe(8, 2, 64, 96, route_scale=2.5, n_groups=2,
                                                                   topk_groups=1, latent_dim=48)),
    "8B": _8b,
    # The 8B's first four layers ("M-M-"): real layer shapes on one GPU; no attention layer among them.
    "8B_4L": dataclasses.replace(_8b, n_layers=4, hybrid_override_pattern=_P8B[:4]),
    # The 8B cut to its first attention layer and the MLP after it ("M-M-M-M*-"): every layer kind at real size.
    "8B_9L": dataclasses.replace(_8b, n_layers=9, hybrid_override_pattern=_P8B[:9]),
    "47B": _flavor(_P47B, dim=8192, hidden_dim=30720, n_heads=64, mamba_n_heads=256, ssm_state_size=256),
    "56B": _flavor(_P56B, dim=8192, hidden_dim=32768, n_heads=64, mamba_n_heads=256, ssm_state_size=256),
    "nano_9b_v2": _flavor(_PNANO9B, dim=4480, hidden_dim=15680, n_heads=40, mamba_n_heads=128, mamba_head_dim=80,
                          ssm_state_size=128),
    "nano3_30b_a3b": _nano3,
    # Its first six layers ("MEMEM*"): every kind of its layers at real size on one GPU.
    "nano3_30b_a3b_6L": dataclasses.replace(_nano3, n_layers=6, hybrid_override_pattern=_PNANO3[:6]),
}
