"""DeepSeek flavors: named model sizes (run knobs live in configs/; model.n_layers changes the depth).

The shapes follow the published configs: DeepSeek-V2-Lite's config.json for "16B" (the shape torchtitan calls
deepseek_v3 "16B"), DeepSeek-V2's for "236B", DeepSeek-V3's for "671B" (dim, layers, heads, latent ranks, head
dims, experts, expert/dense hidden sizes, vocabulary, routing, YaRN).

Choices and uncertainties, stated rather than hidden:
- Routing of "16B"/"236B": softmax scores as V2/V2-Lite publish them (and torchtitan's 16B), not V3's sigmoid.
  transformers' DeepseekV3ForCausalLM routes with sigmoid only, so these two flavors do not export to it (hf.py
  refuses). V2's group-limited routing ("236B", topk_method group_limited_greedy) ranks a group by its best expert,
  V3 by its two best; this family's MoE implements one rule (models/common/moe.py), V3's.
- YaRN: the published configs carry the context-extension YaRN (factor 40 over 4096 positions), and like HF this
  model applies it at any sequence length. DeepSeek pretrained at 4K without it; torchtitan applies it only when
  training.seq_len > 4096. Checkpoints from HF need it on; a from-scratch run may prefer rope_factor=1.
- mscale of V2/V2-Lite: 0.707 (their config.json; torchtitan's 16B uses 0.70).
- Load balancing: V3 trains with the auxiliary-loss-free expert bias (update rate 0.001) plus a sequence-wise
  balance loss of 1e-4 (V3 report). V2 and V2-Lite published only the sequence-wise expert loss (alpha 0.003 for
  V2, 0.001 for V2-Lite); their flavors keep it and add the bias update at 0.001 as torchtitan's 16B does.
- V2's device- and communication-balance losses are not modelled. V3's multi-token prediction is off in every
  flavor (model.args.mtp_num_layers = 1 turns it on: docs/mtp.md).
"""
from __future__ import annotations

from models.common.moe import MoEArgs
from models.deepseek_v3.args import ModelArgs

# DeepSeek-V2-Lite: 27 layers, first dense, 64 routed experts (top 6) + 2 shared, no q compression.
_V2_LITE = dict(
    dim=2048, n_heads=16, vocab_size=102400, n_dense_layers=1, dense_hidden_dim=10944,
    q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    rope_theta=10000.0, rope_factor=40.0, rope_original_max_position=4096, rope_beta_fast=32.0, rope_beta_slow=1.0,
    rope_mscale=0.707, rope_mscale_all_dim=0.707,
)


def _v2_lite_moe() -> MoEArgs:
    return MoEArgs(num_experts=64, top_k=6, hidden_dim=1408, num_shared_experts=2, score_func="softmax",
                   route_norm=False, route_scale=1.0, seq_aux_loss_coeff=0.001, bias_update_rate=1e-3)


deepseek_v3_flavors: dict[str, ModelArgs] = {
    # Tiny model for CPU tests and smoke runs (vocab_size comes from the tokenizer): one dense block first, then
    # sigmoid routing over 8 experts in 4 groups (tokens may use 2 groups), a shared expert, q compression and YaRN
    # on, so every path of the full-size model runs.
    "debugmodel": ModelArgs(
        dim=256, n_layers=4, n_heads=8, vocab_size=2048, max_seq_len=2048, n_dense_layers=1, dense_hidden_dim=512,
        q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        rope_factor=4.0, rope_original_max_position=256, rope_mscale=1.0, rope_mscale_all_dim=1.0,
        moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=128, num_shared_experts=1, score_func="sigmoid",
                    route_norm=True, route_scale=1.0, n_groups=4, topk_groups=2, seq_aux_loss_coeff=1e-4,
                    bias_update_rate=1e-2),  # 10x V3's rate: balancing shows within a 60-step smoke run
    ),
    "16B": ModelArgs(n_layers=27, **_V2_LITE, moe=_v2_lite_moe()),
    # 16B's layer shapes with 4 layers (1 dense + 3 MoE): the benchmark's cut, one GPU.
    "16B_4L": ModelArgs(n_layers=4, **_V2_LITE, moe=_v2_lite_moe()),
    # DeepSeek-V2: 60 layers, first dense, 160 routed experts (top 6, in 8 groups of which 3) + 2 shared.
    "236B": ModelArgs(
        dim=5120, n_layers=60, n_heads=128, vocab_size=102400, n_dense_layers=1, dense_hidden_dim=12288,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        rope_theta=10000.0, rope_factor=40.0, rope_original_max_position=4096, rope_beta_fast=32.0,
        rope_beta_slow=1.0, rope_mscale=0.707, rope_mscale_all_dim=0.707,
        moe=MoEArgs(num_experts=160, top_k=6, hidden_dim=1536, num_shared_experts=2, score_func="softmax",
                    route_norm=False, route_scale=16.0, n_groups=8, topk_groups=3, seq_aux_loss_coeff=0.003,
                    bias_update_rate=1e-3),
    ),
    # DeepSeek-V3: 61 layers, first 3 dense, 256 routed experts (top 8, in 8 groups of which 4) + 1 shared.
    "671B": ModelArgs(
        dim=7168, n_layers=61, n_heads=128, vocab_size=129280, n_dense_layers=3, dense_hidden_dim=18432,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        rope_theta=10000.0, rope_factor=40.0, rope_original_max_position=4096, rope_beta_fast=32.0,
        rope_beta_slow=1.0, rope_mscale=1.0, rope_mscale_all_dim=1.0,
        moe=MoEArgs(num_experts=256, top_k=8, hidden_dim=2048, num_shared_experts=1, score_func="sigmoid",
                    route_norm=True, route_scale=2.5, n_groups=8, topk_groups=4, seq_aux_loss_coeff=1e-4,
                    bias_update_rate=1e-3),
    ),
}
