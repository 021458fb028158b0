"""Arguments of the hybrid Mamba-2 families: HybridArgs (every layer a Mamba-2 mixer: models/mamba2 subclasses it)
and NemotronHArgs (Megatron's hybrid layer pattern: Mamba-2, attention and MLP layers). Named sizes in flavors.py."""
from __future__ import annotations

import math
from dataclasses import dataclass

from models.common.moe_args import MoEArgs

# Megatron's hybrid_override_pattern letters (megatron/core/ssm/mamba_hybrid_layer_allocation.py's symbols).
MAMBA, ATTENTION, MLP, MOE = "M", "*", "-", "E"
LETTERS = {MAMBA: "Mamba-2", ATTENTION: "attention", MLP: "MLP", MOE: "MoE"}


@dataclass
class HybridArgs:
    """A stack of pre-norm residual blocks, one mixer each; here every block is a Mamba-2 mixer (pattern()). The
    Mamba fields are HF's (Mamba2Config / NemotronHConfig): inner width = mamba_n_heads x mamba_head_dim; B and C
    have ssm_state_size channels in each of n_groups groups."""

    dim: int = 768
    n_layers: int = 24
    vocab_size: int = 50288
    max_seq_len: int = 2048  # no positional table: the trainer sets it, nothing reads it but generation's limit
    norm_eps: float = 1e-5
    mamba_n_heads: int = 24
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 1
    conv_kernel: int = 4
    chunk_size: int = 256  # the SSD scan's chunk (a kernel choice that changes no result beyond rounding)
    # Step sizes: dt_limit clamps softplus(dt + dt_bias) (Mamba2Config.time_step_limit); dt_min/dt_max/dt_floor draw
    # dt_bias at init (time_step_min/max/floor).
    dt_limit: tuple[float, float] = (0.0, math.inf)
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_floor: float = 1e-4
    mamba_bias: bool = False  # in_proj / out_proj biases (use_bias)
    conv_bias: bool = True  # use_conv_bias

    def __post_init__(self) -> None:
        self.dt_limit = (float(self.dt_limit[0]), float(self.dt_limit[1]))  # JSON brings a list back
        if self.mamba_n_heads % self.n_groups:
            raise ValueError(f"model.args.mamba_n_heads={self.mamba_n_heads} must be a multiple of "
                             f"model.args.n_groups={self.n_groups}; change one of them")

    def pattern(self) -> str:
        """One letter per layer (MAMBA, ATTENTION, MLP, MOE)."""
        return MAMBA * self.n_layers

    def mixer_dt_limit(self) -> tuple[float, float]:
        return self.dt_limit


@dataclass
class NemotronHArgs(HybridArgs):
    """NemotronH (HF NemotronHForCausalLM; Megatron's hybrid model): layer i is `hybrid_override_pattern[i]`, "M"
    Mamba-2, "*" attention (grouped KV heads, no positional encoding: NemotronH's attention has no RoPE), "-" a
    squared-ReLU MLP, "E" a mixture of experts (models/common/moe.py's MoE by `moe`: NemotronH's is squared-ReLU
    experts and shared expert, sigmoid routing with a selection bias, optionally a latent projection). NemotronH
    clamps dt from below at dt_min (its dt_limit is ignored)."""

    dim: int = 4096
    n_layers: int = 52
    hybrid_override_pattern: str = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
    vocab_size: int = 131072
    mamba_n_heads: int = 128
    mamba_head_dim: int = 64
    n_groups: int = 8
    chunk_size: int = 128
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    hidden_dim: int = 21504  # the MLP's hidden size (intermediate_size)
    attention_bias: bool = False
    mlp_bias: bool = False
    repeat_kv_heads: bool = False  # a kernel choice (the trainer sets it), as in the other GQA families
    moe: MoEArgs | None = None  # the "E" layers' MoE (None: a pattern without "E")

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.moe, dict):  # a checkpoint's JSON brings the nested MoEArgs back as a dict
            self.moe = MoEArgs(**self.moe)
        bad = sorted(set(self.hybrid_override_pattern) - set(LETTERS))
        if bad:
            raise ValueError(f"model.args.hybrid_override_pattern has unknown letters {bad}; use only "
                             + ", ".join(f"{k!r} ({v})" for k, v in LETTERS.items()))
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.args.n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")

    def pattern(self) -> str:
        return self.hybrid_override_pattern

    def mixer_dt_limit(self) -> tuple[float, float]:
        return (self.dt_min, math.inf)


def pattern_problems(args: HybridArgs, flavor: str) -> list[str]:
    """The pattern against the depth: one line naming the keys and the fix (model.n_layers cuts a flavor's depth,
    which a hybrid pattern cannot follow on its own)."""
    p = args.pattern()
    if len(p) != args.n_layers:
        return [f"model.flavor {flavor!r}: hybrid_override_pattern has {len(p)} layers but n_layers={args.n_layers}; "
                f"set model.n_layers={len(p)} (0: the flavor's) or give model.args.hybrid_override_pattern "
                f"{args.n_layers} letters"]
    if MOE in p and getattr(args, "moe", None) is None:
        return [f"model.flavor {flavor!r}: hybrid_override_pattern has 'E' (MoE) layers but model.args.moe is "
                f"unset; give the flavor MoEArgs (models/common/moe_args.py) or drop the 'E' layers"]
    return []
