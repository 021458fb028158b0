"""Qwen3 flavors: named model sizes (run knobs live in configs/; model.n_layers changes the depth).

The real sizes follow the published config.json files of Qwen/Qwen3-{0.6B,1.7B,4B,8B,14B,32B} (Qwen3ForCausalLM)
and Qwen/Qwen3-{30B-A3B,235B-A22B} (Qwen3MoeForCausalLM): hidden_size, num_hidden_layers, num_attention_heads,
num_key_value_heads, head_dim 128, intermediate_size, moe_intermediate_size, num_experts, num_experts_per_tok,
norm_topk_prob, router_aux_loss_coef, rope_theta 1e6, rms_norm_eps 1e-6, vocab 151936.

Tied embeddings: Qwen3-0.6B, 1.7B and 4B tie lm_head to the embedding upstream. titanlike's Qwen3 does not tie (as its
Llama; only GPT does): a tied weight would span two FSDP groups, two pipeline stages and the float8 / chunked-loss swaps
of the output layer. These flavors therefore carry a separate `output` matrix (151936 x dim more parameters: 0.6B counts
~0.75B); importing a tied HF checkpoint copies the embedding into `output` (models/qwen3/hf.py).
"""
from __future__ import annotations

import dataclasses

from models.common.moe import MoEArgs
from models.qwen3.args import Qwen3Args


def _dense(dim: int, n_layers: int, n_heads: int, hidden_dim: int, n_kv_heads: int = 8) -> Qwen3Args:
    return Qwen3Args(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=128,
                     hidden_dim=hidden_dim)


def _moe(dim: int, n_layers: int, n_heads: int, hidden_dim: int, moe_hidden: int) -> Qwen3Args:
    # Softmax over all experts, top 8 of 128, the 8 weights renormalised (norm_topk_prob), no shared expert; the
    # published router_aux_loss_coef (0.001) as the load-balancing loss.
    moe = MoEArgs(num_experts=128, top_k=8, hidden_dim=moe_hidden, score_func="softmax", route_norm=True,
                  aux_loss_coeff=0.001)
    return Qwen3Args(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=4, head_dim=128, hidden_dim=hidden_dim,
                     moe=moe)


_30b_a3b = _moe(dim=2048, n_layers=48, n_heads=32, hidden_dim=6144, moe_hidden=768)

qwen3_flavors: dict[str, Qwen3Args] = {
    # Tiny dense model for CPU tests and smoke runs (vocab_size comes from the tokenizer). n_heads * head_dim (512)
    # differs from dim (256) on purpose, as in the real Qwen3 shapes.
    "debugmodel": Qwen3Args(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, hidden_dim=768,
                            vocab_size=2048, max_seq_len=2048),
    # Tiny MoE: 8 experts, top 2, on every layer.
    "debugmodel_moe": Qwen3Args(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, hidden_dim=768, vocab_size=2048,
        max_seq_len=2048, moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=256, score_func="softmax",
                                      route_norm=True, aux_loss_coeff=0.001)),
    "0.6B": _dense(dim=1024, n_layers=28, n_heads=16, hidden_dim=3072),
    "1.7B": _dense(dim=2048, n_layers=28, n_heads=16, hidden_dim=6144),
    "4B": _dense(dim=2560, n_layers=36, n_heads=32, hidden_dim=9728),
    "8B": _dense(dim=4096, n_layers=36, n_heads=32, hidden_dim=12288),
    "14B": _dense(dim=5120, n_layers=40, n_heads=40, hidden_dim=17408),
    "32B": _dense(dim=5120, n_layers=64, n_heads=64, hidden_dim=25600),
    # MoE: every layer is sparse (decoder_sparse_step 1, no mlp_only_layers); hidden_dim (intermediate_size) is
    # kept for the HF config round trip only.
    "30B-A3B": _30b_a3b,
    # The 30B-A3B shape cut to 4 layers: the benchmark's MoE case (fits one GPU, real layer shapes).
    "30B-A3B_4L": dataclasses.replace(_30b_a3b, n_layers=4),
    "235B-A22B": _moe(dim=4096, n_layers=94, n_heads=64, hidden_dim=12288, moe_hidden=1536),
}
