"""Qwen3 model arguments, dense and mixture-of-experts (named sizes in flavors.py; run knobs live in configs/)."""
from __future__ import annotations

from dataclasses import dataclass

from models.common.moe import MoEArgs


@dataclass
class Qwen3Args:
    dim: int = 1024
    n_layers: int = 28
    n_heads: int = 16
    n_kv_heads: int = 8
    # Qwen3 sets the head size on its own (128 in every published size), not dim // n_heads: q/k/v project
    # dim -> n_heads * head_dim, and wo projects back.
    head_dim: int = 128
    hidden_dim: int = 3072  # the dense SwiGLU FFN's hidden size (HF intermediate_size)
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    # Length of the precomputed RoPE table; the trainer sets it to training.seq_len.
    max_seq_len: int = 40960  # Qwen3's max_position_embeddings; the trainer sets it to training.seq_len
    # Mixture of experts: None = dense (Qwen3ForCausalLM). Otherwise block i's FFN is the MoE when
    # (i + 1) % moe_layer_step == 0 and i is not in mlp_only_layers (HF decoder_sparse_step, mlp_only_layers),
    # else the dense FFN of hidden_dim.
    moe: MoEArgs | None = None
    moe_layer_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # A kernel choice, not architecture (see models/llama3/args.py): the trainer sets it.
    repeat_kv_heads: bool = False

    def __post_init__(self) -> None:
        # Checkpoints store dataclasses.asdict(args) as JSON and rebuild with Qwen3Args(**d): the nested MoEArgs
        # comes back as a dict and the tuple as a list.
        if isinstance(self.moe, dict):
            self.moe = MoEArgs(**self.moe)
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        if self.moe_layer_step < 1:
            raise ValueError(f"moe_layer_step ({self.moe_layer_step}) must be >= 1")

    def is_moe_layer(self, layer_id: int) -> bool:
        return (self.moe is not None and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.moe_layer_step == 0)

    def moe_layer_ids(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.is_moe_layer(i)]
