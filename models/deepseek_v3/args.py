"""DeepSeek-V3 model arguments (the named sizes are in flavors.py; run knobs live in configs/)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from models.common.moe import MoEArgs


@dataclass
class ModelArgs:
    dim: int = 2048
    n_layers: int = 27
    n_heads: int = 16
    vocab_size: int = 102400
    # The context the flavor is made for (YaRN: rope_original_max_position x rope_factor); the trainer sets it to
    # training.seq_len, the length of the precomputed RoPE table.
    max_seq_len: int = 163840
    norm_eps: float = 1e-6  # the block and final norms; the q/kv latent norms use 1e-6 always (as HF does)

    # Multi-head latent attention. q_lora_rank 0: a plain wq (DeepSeek-V2-Lite); > 0: wq_a -> RMSNorm -> wq_b.
    q_lora_rank: int = 0
    kv_lora_rank: int = 512  # the compressed KV latent (what an inference cache would hold)
    qk_nope_head_dim: int = 128  # per-head query/key channels without position
    qk_rope_head_dim: int = 64  # per-head query channels with RoPE; the key's are one head shared by all heads
    v_head_dim: int = 128

    # RoPE on the qk_rope_head_dim channels, with YaRN when rope_factor > 1 (HF rope_type "yarn"; 1 = plain RoPE).
    rope_theta: float = 10000.0
    rope_factor: float = 1.0
    rope_original_max_position: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 0.0  # > 0: the softmax scale is multiplied by yarn_mscale(factor, this) ** 2

    # Feed-forward: the first n_dense_layers blocks are dense SwiGLU (HF first_k_dense_replace), the rest MoE.
    n_dense_layers: int = 1
    dense_hidden_dim: int = 10944  # HF intermediate_size
    moe: MoEArgs = field(default_factory=MoEArgs)
    # Multi-token prediction (models/common/mtp.py, docs/mtp.md): this many sequential MTP modules after the main
    # model (0 = off; DeepSeek-V3 publishes 1), their summed losses weighted mtp_loss_weight / mtp_num_layers. The
    # default weight is Megatron's --mtp-loss-scaling-factor (0.1); DeepSeek-V3 trained with 0.3, then 0.1.
    mtp_num_layers: int = 0
    mtp_loss_weight: float = 0.1

    def __post_init__(self) -> None:
        # Checkpoints store dataclasses.asdict(args) (MoEArgs becomes a dict) and rebuild with ModelArgs(**d).
        if isinstance(self.moe, dict):
            self.moe = MoEArgs(**self.moe)
        else:  # a copy: flavors are shared, and dataclasses.replace would hand every run the flavor's object
            self.moe = dataclasses.replace(self.moe)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")
        if self.n_dense_layers < 0:
            raise ValueError(f"n_dense_layers must be >= 0, got {self.n_dense_layers}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.n_dense_layers

    @property
    def n_moe_layers(self) -> int:
        return max(self.n_layers - self.n_dense_layers, 0)
