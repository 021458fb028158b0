"""Mixtral flavors: named model sizes (run knobs live in configs/; model.n_layers changes the depth).

The real sizes follow the published config.json files of mistralai/Mixtral-8x7B-v0.1 and Mixtral-8x22B-v0.1
(MixtralForCausalLM): hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size,
num_local_experts 8, num_experts_per_tok 2, router_aux_loss_coef, rope_theta 1e6, rms_norm_eps 1e-5, vocab 32000
(the v0.3 / Instruct 8x22B releases use 32768: vocab_size is a run setting, taken from the tokenizer). Untied
embeddings, as upstream.
"""
from __future__ import annotations

from models.common.moe import MoEArgs
from models.mixtral.args import MixtralArgs


def _moe(hidden_dim: int, aux_loss_coeff: float) -> MoEArgs:
    return MoEArgs(num_experts=8, top_k=2, hidden_dim=hidden_dim, score_func="softmax", route_norm=True,
                   aux_loss_coeff=aux_loss_coeff)


mixtral_flavors: dict[str, MixtralArgs] = {
    # Tiny model for CPU tests and smoke runs (vocab_size comes from the tokenizer).
    "debugmodel": MixtralArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=2048, max_seq_len=2048,
                              moe=_moe(hidden_dim=256, aux_loss_coeff=0.02)),
    "8x7B": MixtralArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, moe=_moe(14336, aux_loss_coeff=0.02)),
    "8x22B": MixtralArgs(dim=6144, n_layers=56, n_heads=48, n_kv_heads=8, moe=_moe(16384, aux_loss_coeff=0.001)),
}
