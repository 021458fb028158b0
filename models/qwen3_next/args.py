"""Qwen3-Next model arguments (named sizes in flavors.py; run knobs live in configs/)."""
from __future__ import annotations

from dataclasses import dataclass

from models.common.moe import MoEArgs

LAYER_TYPES = ("linear_attention", "full_attention")  # HF config.json layer_types values


@dataclass
class Qwen3NextArgs:
    dim: int = 2048
    n_layers: int = 48
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    # Which mixer each layer has: "full_attention" (gated attention) or "linear_attention" (Gated DeltaNet). Empty:
    # every full_attention_interval-th layer is attention, the rest linear (HF's default, 3:1 at interval 4).
    layer_types: tuple[str, ...] = ()
    full_attention_interval: int = 4
    # Gated attention (models/common/attention.py GatedAttention): its own head size, q/k zero-centred RMSNorm,
    # RoPE on the first head_dim * partial_rotary_factor channels of each head.
    n_heads: int = 16
    n_kv_heads: int = 2
    head_dim: int = 256
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10_000_000.0
    max_seq_len: int = 4096  # length of the RoPE table; the trainer sets it to training.seq_len
    # Gated DeltaNet (models/common/gated_deltanet.py): HF linear_num_key_heads, linear_num_value_heads,
    # linear_key_head_dim, linear_value_head_dim, linear_conv_kernel_dim.
    linear_n_k_heads: int = 16
    linear_n_v_heads: int = 32
    linear_head_k_dim: int = 128
    linear_head_v_dim: int = 128
    linear_conv_kernel: int = 4
    linear_chunk_size: int = 64  # the chunked delta rule's chunk (a kernel knob: the result does not depend on it)
    # Dense SwiGLU FFN size (HF intermediate_size): the layers without experts (mlp_only_layers, decoder_sparse_step).
    hidden_dim: int = 5632
    # Routed experts (None: every layer dense) and the sigmoid-gated shared expert beside them (HF
    # shared_expert_intermediate_size; 0: none). Layer i is MoE when (i + 1) % moe_layer_step == 0 and i is not in
    # mlp_only_layers (HF decoder_sparse_step, mlp_only_layers).
    moe: MoEArgs | None = None
    shared_hidden_dim: int = 512
    moe_layer_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    repeat_kv_heads: bool = False  # a kernel choice, not architecture: the trainer sets it

    def __post_init__(self) -> None:
        # Checkpoints store dataclasses.asdict(args) as JSON: MoEArgs comes back as a dict, tuples as lists.
        if isinstance(self.moe, dict):
            self.moe = MoEArgs(**self.moe)
        self.layer_types = tuple(self.layer_types)
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        if self.layer_types and len(self.layer_types) != self.n_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for n_layers={self.n_layers}; give "
                             f"one per layer or leave it empty to use full_attention_interval")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"layer_types has {bad[0]!r}; use {' or '.join(LAYER_TYPES)}")
        if self.full_attention_interval < 1:
            raise ValueError(f"full_attention_interval ({self.full_attention_interval}) must be >= 1")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.linear_n_v_heads % self.linear_n_k_heads:
            raise ValueError(f"linear_n_v_heads ({self.linear_n_v_heads}) must be a multiple of linear_n_k_heads "
                             f"({self.linear_n_k_heads})")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"head_dim * partial_rotary_factor ({self.head_dim} * {self.partial_rotary_factor}) "
                             f"must be an even number of channels in 2..head_dim")
        if self.moe_layer_step < 1:
            raise ValueError(f"moe_layer_step ({self.moe_layer_step}) must be >= 1")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)  # int(): HF's truncation

    def is_full_attention(self, layer_id: int) -> bool:
        if self.layer_types:
            return self.layer_types[layer_id] == "full_attention"
        return (layer_id + 1) % self.full_attention_interval == 0

    def is_moe_layer(self, layer_id: int) -> bool:
        return (self.moe is not None and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.moe_layer_step == 0)

    def layer_kind(self, layer_id: int) -> tuple[bool, bool]:
        """(full attention?, MoE?): the blocks of one kind have the same parameters and cost."""
        return self.is_full_attention(layer_id), self.is_moe_layer(layer_id)

    def hf_layer_types(self) -> list[str]:
        return [LAYER_TYPES[self.is_full_attention(i)] for i in range(self.n_layers)]
