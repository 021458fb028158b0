"""State-dict adapter between titanlike Qwen3-Next and Hugging Face `transformers` Qwen3NextForCausalLM. Pure
tensor/dict code (no `transformers` import).

Names: the DeltaNet's parameters keep HF's names under `linear_attn.` (models/common/gated_deltanet.py uses them);
attention, norms, FFN and the shared expert are renamed (_LAYER_MAP). Routed experts: export writes the hub's
per-expert keys (mlp.experts.<e>.{gate,up,down}_proj.weight, which transformers 5.x fuses on load); import reads
those or a 5.x model's fused tensors (models/common/hf_utils.py).

RoPE layout: titanlike rotates interleaved channel pairs, HF the two halves of the rotated channels; Qwen3-Next
rotates only the first rotary_dim = head_dim * partial_rotary_factor channels of each head, so only those rows of
wq's query half (HF q_proj holds, per head, the query's head_dim rows then the gate's), of wk and of the q/k norm
weights are permuted (the norm scales channels before the rotation).

DeltaNet conv1d: ours is key-head-major (per key head its q, k, v channels: what tensor parallelism shards), HF's
[all q | all k | all v]; the channels are permuted both ways (models/common/gated_deltanet.py conv_hf_order).
"""
from __future__ import annotations

import torch

from models.common.hf_utils import (MLP_EXPERTS, add_zero_expert_biases, half_to_interleaved, hf_layer_items, hf_rope,
                                    interleaved_to_half, read_mlp_experts, refuse_trained_expert_bias, stack_experts,
                                    titanlike_layer_items, unstack_experts, untie_output)
from models.common.gated_deltanet import conv_hf_order
from models.common.moe import MoEArgs
from models.qwen3_next.args import Qwen3NextArgs

ARCHITECTURES = ("Qwen3NextForCausalLM",)
MODEL_TYPES = ("qwen3_next",)

_DELTANET = ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "dt_bias", "A_log", "norm.weight",
             "out_proj.weight")
_LAYER_MAP = {  # titanlike per-layer suffix -> HF per-layer suffix (routed experts apart)
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.shared_expert.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "moe.shared_expert.w3.weight": "mlp.shared_expert.up_proj.weight",
    "moe.shared_expert.w2.weight": "mlp.shared_expert.down_proj.weight",
    "moe.shared_expert_gate.weight": "mlp.shared_expert_gate.weight",
    **{f"linear_attn.{s}": f"linear_attn.{s}" for s in _DELTANET},
}
_LAYER_MAP_INV = {v: k for k, v in _LAYER_MAP.items()}


def _reorder_rows(suffix: str, value: torch.Tensor, args: Qwen3NextArgs, to_hf: bool) -> torch.Tensor:
    """The rotated rows of wq's query half, wk and the q/k norms in the other layout, the DeltaNet's conv channels in
    the other order; other tensors unchanged."""
    hd, rd = args.head_dim, args.rotary_dim
    if suffix == "linear_attn.conv1d.weight":
        order = conv_hf_order(args.linear_n_k_heads, args.linear_head_k_dim, args.linear_n_v_heads,
                              args.linear_head_v_dim)
        return value.index_select(0, (torch.argsort(order) if to_hf else order).to(value.device))
    if suffix == "attention.wq.weight":
        shape, parts = (args.n_heads, 2, hd), (0,)  # per head: query rows, then gate rows
    elif suffix == "attention.wk.weight":
        shape, parts = (args.n_kv_heads, 1, hd), (0,)
    elif suffix in ("attention.q_norm.weight", "attention.k_norm.weight"):
        shape, parts = (1, 1, hd), (0,)
    else:
        return value
    fn = interleaved_to_half if to_hf else half_to_interleaved
    w = value.reshape(*shape, *value.shape[1:]).clone()
    heads, rest = shape[0], value.shape[1:]
    for p in parts:
        w[:, p, :rd] = fn(w[:, p, :rd].reshape(heads * rd, *rest), heads).reshape(heads, rd, *rest)
    return w.reshape(value.shape)


def to_hf(state_dict: dict[str, torch.Tensor], args: Qwen3NextArgs) -> dict[str, torch.Tensor]:
    """titanlike FQNs -> HF FQNs. Works on partial state dicts (one layer, one pipeline stage); whole tensors only."""
    out: dict[str, torch.Tensor] = {}
    for key, layer, suffix, value in titanlike_layer_items(state_dict, out):
        prefix = f"model.layers.{layer}."
        if suffix == "moe.expert_bias":
            refuse_trained_expert_bias(key, value, "Qwen3-Next")
        elif suffix in MLP_EXPERTS:
            out.update(unstack_experts(value, f"{prefix}mlp.experts.", f".{MLP_EXPERTS[suffix]}.weight"))
        elif suffix in _LAYER_MAP:
            out[prefix + _LAYER_MAP[suffix]] = _reorder_rows(suffix, value, args, to_hf=True)
        else:
            raise KeyError(f"to_hf: unexpected titanlike key {key!r}")
    return out


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: Qwen3NextArgs) -> dict[str, torch.Tensor]:
    """HF FQNs -> titanlike FQNs: per-expert or fused experts in, stacked [E, ...] out; a zero expert_bias per MoE
    layer; lm_head from the embedding when tied. The published checkpoint's multi-token-prediction head (`mtp.*`)
    is skipped, as transformers skips it."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    hf_state_dict = {k: v for k, v in hf_state_dict.items() if not k.startswith("mtp.")}
    for key, layer, suffix, value in hf_layer_items(hf_state_dict, out):
        prefix = f"layers.{layer}."
        if read_mlp_experts(suffix, value, prefix, out, experts):
            continue
        if suffix not in _LAYER_MAP_INV:
            raise KeyError(f"from_hf: unexpected HF key {key!r}")
        tl_suffix = _LAYER_MAP_INV[suffix]
        out[prefix + tl_suffix] = _reorder_rows(tl_suffix, value, args, to_hf=False)
    num_experts = args.moe.num_experts if args.moe else 0
    out.update(stack_experts(experts, num_experts))
    add_zero_expert_biases(out, num_experts)
    untie_output(out)
    return out


def args_from_hf_config(config: dict) -> Qwen3NextArgs:
    """Qwen3NextArgs from a HF Qwen3Next config.json dict (5.x `rope_parameters` or 4.x `rope_theta` /
    `partial_rotary_factor`); layer_types, else full_attention_interval (default 4), decide the mixers."""
    if config.get("attention_bias"):
        raise ValueError("HF config has attention_bias=True; titanlike Qwen3-Next has no attention biases")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"HF config has hidden_act={config['hidden_act']!r}; titanlike Qwen3-Next uses SwiGLU (silu)")
    rope, rope_type, theta = hf_rope(config, default_theta=10_000.0)
    if rope_type != "default":
        raise ValueError(f"unsupported rope_type {rope_type!r}: titanlike Qwen3-Next has plain (partial) RoPE")
    n_layers, dim, n_heads = config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]
    layer_types = config.get("layer_types")
    if not layer_types:
        interval = config.get("full_attention_interval", 4)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    moe = None
    if config.get("num_experts", 0) > 0:
        moe = MoEArgs(num_experts=config["num_experts"], top_k=config["num_experts_per_tok"],
                      hidden_dim=config["moe_intermediate_size"], score_func="softmax",
                      route_norm=bool(config.get("norm_topk_prob", True)),
                      aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.0)))
    return Qwen3NextArgs(
        dim=dim, n_layers=n_layers, vocab_size=config["vocab_size"], norm_eps=config.get("rms_norm_eps", 1e-6),
        layer_types=tuple(layer_types), n_heads=n_heads, n_kv_heads=config.get("num_key_value_heads") or n_heads,
        head_dim=config.get("head_dim") or dim // n_heads,
        partial_rotary_factor=float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))),
        rope_theta=theta, max_seq_len=config.get("max_position_embeddings", 4096),
        linear_n_k_heads=config["linear_num_key_heads"], linear_n_v_heads=config["linear_num_value_heads"],
        linear_head_k_dim=config["linear_key_head_dim"], linear_head_v_dim=config["linear_value_head_dim"],
        linear_conv_kernel=config.get("linear_conv_kernel_dim", 4), hidden_dim=config["intermediate_size"],
        moe=moe, shared_hidden_dim=config.get("shared_expert_intermediate_size", 0) if moe else 0,
        moe_layer_step=config.get("decoder_sparse_step", 1) if moe else 1,
        mlp_only_layers=tuple(config.get("mlp_only_layers") or ()) if moe else (),
    )


def hf_config(args: Qwen3NextArgs, dtype: torch.dtype, max_position_embeddings: int | None = None) -> dict:
    """A transformers Qwen3NextConfig dict for these args (rope keys in both the 5.x and the 4.x spelling)."""
    rope = {"rope_type": "default", "rope_theta": args.rope_theta, "partial_rotary_factor": args.partial_rotary_factor}
    cfg = {
        "architectures": list(ARCHITECTURES), "model_type": MODEL_TYPES[0], "hidden_act": "silu",
        "hidden_size": args.dim, "intermediate_size": args.hidden_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "rope_parameters": rope,
        "rope_theta": args.rope_theta, "partial_rotary_factor": args.partial_rotary_factor,
        "max_position_embeddings": max_position_embeddings or args.max_seq_len, "tie_word_embeddings": False,
        "attention_bias": False, "layer_types": args.hf_layer_types(),
        "linear_num_key_heads": args.linear_n_k_heads, "linear_num_value_heads": args.linear_n_v_heads,
        "linear_key_head_dim": args.linear_head_k_dim, "linear_value_head_dim": args.linear_head_v_dim,
        "linear_conv_kernel_dim": args.linear_conv_kernel, "torch_dtype": str(dtype).replace("torch.", ""),
        "num_experts": 0, "mlp_only_layers": [], "decoder_sparse_step": 1,
    }
    if args.moe:
        m = args.moe
        if (m.score_func != "softmax" or m.num_shared_experts or m.n_groups > 1 or m.route_scale != 1.0
                or args.shared_hidden_dim <= 0):
            raise ValueError("hf_config: HF's Qwen3-Next routes by softmax over all experts, top-k, beside one gated "
                             "shared expert, without groups or a route scale; these args differ")
        cfg.update({"num_experts": m.num_experts, "num_experts_per_tok": m.top_k,
                    "moe_intermediate_size": m.hidden_dim, "norm_topk_prob": m.route_norm,
                    "shared_expert_intermediate_size": args.shared_hidden_dim,
                    "decoder_sparse_step": args.moe_layer_step, "mlp_only_layers": list(args.mlp_only_layers),
                    "router_aux_loss_coef": m.aux_loss_coeff, "output_router_logits": False})
    return cfg
