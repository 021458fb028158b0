"""State-dict adapter between titanlike Qwen3 and Hugging Face `transformers` Qwen3ForCausalLM /
Qwen3MoeForCausalLM. Pure tensor/dict code (no `transformers` import).

RoPE layout: titanlike rotates interleaved channel pairs (models/common/rope.py), HF the two halves of each head
(`rotate_half`). The rows of wq and wk are permuted per head, and so are the q_norm / k_norm weights (they scale the
head's channels before the rotation, so they follow the same permutation): titanlike channel (pair i, member j) <->
HF channel j * head_dim/2 + i. wv, wo and everything else keep their layout.

Experts: export writes the per-expert keys of the published checkpoints (mlp.experts.<e>.{gate,up,down}_proj.weight),
which transformers 4.x loads as they are and 5.x fuses on load; import reads those or the fused tensors that a 5.x
model's own state_dict holds (mlp.experts.gate_up_proj [E, 2*hidden, dim], mlp.experts.down_proj [E, dim, hidden]).
Tied embeddings: a checkpoint without lm_head gets a copy of the embedding (titanlike's Qwen3 does not tie; flavors.py).
"""
from __future__ import annotations

import torch

from models.common.hf_utils import (MLP_EXPERTS, add_zero_expert_biases, half_to_interleaved, hf_layer_items, hf_rope,
                                    interleaved_to_half, read_mlp_experts, refuse_trained_expert_bias, stack_experts,
                                    titanlike_layer_items, unstack_experts, untie_output)
from models.common.moe import MoEArgs
from models.qwen3.args import Qwen3Args

ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")  # export writes the one that fits the args
MODEL_TYPES = ("qwen3", "qwen3_moe")

_LAYER_MAP = {  # titanlike per-layer suffix -> HF per-layer suffix (experts are handled apart)
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
}
_LAYER_MAP_INV = {v: k for k, v in _LAYER_MAP.items()}
_ROTATED = {"attention.wq.weight": "n_heads", "attention.wk.weight": "n_kv_heads",
            "attention.q_norm.weight": None, "attention.k_norm.weight": None}  # None: one head (a norm weight)


def _heads(suffix: str, args) -> int:
    attr = _ROTATED[suffix]
    return 1 if attr is None else getattr(args, attr)


def to_hf(state_dict: dict[str, torch.Tensor], args: Qwen3Args) -> dict[str, torch.Tensor]:
    """titanlike FQNs -> HF FQNs (the published checkpoints' names). Works on partial state dicts (one layer, one
    pipeline stage); tensors must be full, not sharded DTensors."""
    out: dict[str, torch.Tensor] = {}
    for key, layer, suffix, value in titanlike_layer_items(state_dict, out):
        prefix = f"model.layers.{layer}."
        if suffix == "moe.expert_bias":
            refuse_trained_expert_bias(key, value, "Qwen3-MoE")
        elif suffix in MLP_EXPERTS:
            out.update(unstack_experts(value, f"{prefix}mlp.experts.", f".{MLP_EXPERTS[suffix]}.weight"))
        elif suffix in _LAYER_MAP:
            if suffix in _ROTATED:
                value = interleaved_to_half(value, _heads(suffix, args))
            out[prefix + _LAYER_MAP[suffix]] = value
        else:
            raise KeyError(f"to_hf: unexpected titanlike key {key!r}")
    return out


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: Qwen3Args) -> dict[str, torch.Tensor]:
    """HF FQNs -> titanlike FQNs: per-expert or fused expert tensors in, stacked [E, ...] experts out; a zero
    expert_bias for each MoE layer (the MoE buffer checkpoints carry); lm_head from the embedding when tied."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}  # titanlike FQN -> expert -> weight
    for key, layer, suffix, value in hf_layer_items(hf_state_dict, out):
        prefix = f"layers.{layer}."
        if read_mlp_experts(suffix, value, prefix, out, experts):
            continue
        if suffix not in _LAYER_MAP_INV:
            raise KeyError(f"from_hf: unexpected HF key {key!r}")
        tl_suffix = _LAYER_MAP_INV[suffix]
        if tl_suffix in _ROTATED:
            value = half_to_interleaved(value, _heads(tl_suffix, args))
        out[prefix + tl_suffix] = value
    # A dense config (args.moe None) reads 0 experts, so expert weights in its checkpoint are refused here.
    num_experts = args.moe.num_experts if args.moe else 0
    out.update(stack_experts(experts, num_experts))
    add_zero_expert_biases(out, num_experts)
    untie_output(out)
    return out


def _rope_theta(config: dict) -> float:
    _, rope_type, rope_theta = hf_rope(config, default_theta=1_000_000.0)
    if rope_type != "default":
        raise ValueError(f"unsupported rope_type {rope_type!r}: titanlike Qwen3 has plain RoPE (no YaRN scaling)")
    return rope_theta


def args_from_hf_config(config: dict) -> Qwen3Args:
    """Qwen3Args from a HF Qwen3 / Qwen3-MoE config.json dict (transformers 4.x `rope_theta` or 5.x
    `rope_parameters`). `tie_word_embeddings` is read by nothing: titanlike unties on import."""
    if config.get("attention_bias"):
        raise ValueError("HF config has attention_bias=True; titanlike Qwen3 has no biases")
    if config.get("use_sliding_window"):
        raise ValueError("HF config has use_sliding_window=True; titanlike Qwen3 attends over the whole sequence")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"HF config has hidden_act={config['hidden_act']!r}; titanlike Qwen3 uses SwiGLU (silu)")
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    moe = None
    n_experts = config.get("num_experts") or config.get("num_local_experts") or 0
    is_moe = config.get("model_type") == "qwen3_moe" or "Qwen3MoeForCausalLM" in (config.get("architectures") or [])
    if is_moe and n_experts > 0:
        moe = MoEArgs(num_experts=n_experts, top_k=config["num_experts_per_tok"],
                      hidden_dim=config["moe_intermediate_size"], score_func="softmax",
                      route_norm=bool(config.get("norm_topk_prob", False)),
                      aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.0)))
    return Qwen3Args(
        dim=dim, n_layers=config["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        head_dim=config.get("head_dim") or dim // n_heads, hidden_dim=config["intermediate_size"],
        vocab_size=config["vocab_size"], norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=_rope_theta(config),
        max_seq_len=config.get("max_position_embeddings", 4096), moe=moe,
        moe_layer_step=config.get("decoder_sparse_step", 1) if moe else 1,
        mlp_only_layers=tuple(config.get("mlp_only_layers") or ()) if moe else (),
    )


def hf_config(args: Qwen3Args, dtype: torch.dtype, max_position_embeddings: int | None = None) -> dict:
    """A transformers Qwen3Config / Qwen3MoeConfig dict for these args (legacy rope keys: read by 4.x and 5.x)."""
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM" if args.moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if args.moe else "qwen3", "hidden_act": "silu",
        "hidden_size": args.dim, "intermediate_size": args.hidden_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
        "rope_scaling": None, "max_position_embeddings": max_position_embeddings or args.max_seq_len,
        "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
        "torch_dtype": str(dtype).replace("torch.", ""),
    }
    if args.moe:
        m = args.moe
        if m.score_func != "softmax" or m.num_shared_experts or m.n_groups > 1 or m.route_scale != 1.0:
            raise ValueError("hf_config: HF's Qwen3-MoE routes by softmax over all experts, top-k, without shared "
                             "experts, groups or a route scale; these args differ")
        cfg.update({"num_experts": m.num_experts, "num_experts_per_tok": m.top_k,
                    "moe_intermediate_size": m.hidden_dim, "norm_topk_prob": m.route_norm,
                    "decoder_sparse_step": args.moe_layer_step, "mlp_only_layers": list(args.mlp_only_layers),
                    "router_aux_loss_coef": m.aux_loss_coeff, "output_router_logits": False})
    return cfg
