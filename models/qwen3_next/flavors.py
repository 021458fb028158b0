"""Qwen3-Next flavors: named model sizes (run knobs live in configs/; model.n_layers changes the depth).

"80B-A3B" is Qwen/Qwen3-Next-80B-A3B's shape, taken from transformers' Qwen3NextConfig defaults (documented as that
model's configuration): 48 layers of dim 2048, every 4th full (gated) attention with 16 query / 2 KV heads of 256
channels and RoPE on a quarter of them, the other three Gated DeltaNet with 16 key / 32 value heads of 128; every
layer MoE with 512 experts of hidden 512, top 10 renormalised, plus a sigmoid-gated shared expert of hidden 512;
vocab 151936, untied output, rms_norm_eps 1e-6, router_aux_loss_coef 0.001. RoPE theta is the published config's
10,000,000 (transformers' default rope_theta, 10,000, is a generic placeholder).
Not modelled: the multi-token-prediction head the published checkpoint carries (`mtp.*`, which transformers also
skips on load).
"""
from __future__ import annotations

import dataclasses

from models.common.moe import MoEArgs
from models.qwen3_next.args import Qwen3NextArgs

_80b_a3b = Qwen3NextArgs(
    dim=2048, n_layers=48, n_heads=16, n_kv_heads=2, head_dim=256, partial_rotary_factor=0.25,
    linear_n_k_heads=16, linear_n_v_heads=32, linear_head_k_dim=128, linear_head_v_dim=128, linear_conv_kernel=4,
    hidden_dim=5632, shared_hidden_dim=512,
    moe=MoEArgs(num_experts=512, top_k=10, hidden_dim=512, score_func="softmax", route_norm=True,
                aux_loss_coeff=0.001),
)

qwen3_next_flavors: dict[str, Qwen3NextArgs] = {
    # Tiny hybrid for CPU tests and smoke runs (vocab_size comes from the tokenizer): 4 layers, the last one
    # attention (3:1), MoE of 8 experts top 2 plus the gated shared expert on every layer.
    "debugmodel": Qwen3NextArgs(
        dim=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, vocab_size=2048, max_seq_len=2048,
        linear_n_k_heads=2, linear_n_v_heads=4, linear_head_k_dim=64, linear_head_v_dim=64, hidden_dim=512,
        shared_hidden_dim=256, moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=64, score_func="softmax",
                                           route_norm=True, aux_loss_coeff=0.001)),
    "80B-A3B": _80b_a3b,
    # The 80B-A3B shape cut to 4 layers (three Gated DeltaNet, one attention): real layer shapes on one GPU.
    "80B-A3B_4L": dataclasses.replace(_80b_a3b, n_layers=4),
}
