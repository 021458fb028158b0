"""State-dict adapter between titanlike DeepSeek-V3 and Hugging Face `transformers` DeepseekV3ForCausalLM.

Pure tensor/dict code (no `transformers` import), so scripts and checkpoint tools can use it cheaply.

Routed experts: titanlike stacks them (moe.experts.w1/w3 [E, hidden, dim], w2 [E, dim, hidden]). from_hf reads
both HF layouts: the hub's one tensor per expert (mlp.experts.{e}.gate_proj.weight, ...) and transformers 5's
in-memory packing (mlp.experts.gate_up_proj [E, 2*hidden, dim], mlp.experts.down_proj). to_hf writes the hub's
per-expert layout, which transformers 4 loads as is and transformers 5 converts on load.

RoPE: no permutation: with rope_interleave=True (transformers' default, and what hf_config writes) HF rotates the
same interleaved pairs as titanlike (mla.py). Configs with rope_interleave=False are refused.
"""

from __future__ import annotations

import torch

from models.common.hf_utils import (MLP_EXPERTS, hf_layer_items, hf_rope, read_mlp_experts, stack_experts,
                                    titanlike_layer_items, unstack_experts)
from models.common.moe import MoEArgs
from models.deepseek_v3.args import ModelArgs

ARCHITECTURES = ("DeepseekV3ForCausalLM",)  # what config.json names; export writes the first
MODEL_TYPES = ("deepseek_v3",)  # read when config.json has no architectures

# titanlike per-layer suffix -> HF per-layer suffix (routed experts are handled apart)
_LAYER_MAP = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",  # aux-loss-free balancing's selection bias
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
_LAYER_MAP_INV = {v: k for k, v in _LAYER_MAP.items()}

# Multi-token prediction (models/common/mtp.py): MTP module k is published as layer n_layers + k, the usual layer
# weights (our mtp.<k>.block.*) beside these (DeepSeek-V3's checkpoint; SGLang's deepseek_nextn reads the same).
_MTP_MAP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
            "norm.weight": "shared_head.norm.weight"}
_MTP_MAP_INV = {v: k for k, v in _MTP_MAP.items()}
# The layer's own copies of the shared embedding and output head: written on export, skipped on import.
_MTP_SHARED = {"embed_tokens.weight": "tok_embeddings.weight", "shared_head.head.weight": "output.weight"}


def _mtp_to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs, out: dict) -> dict[str, torch.Tensor]:
    """Writes the MTP modules' own keys into `out` under the published names; returns the rest of the state dict,
    with each module's block renamed to layers.<n_layers + k>.* for the per-layer mapping."""
    rest: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if not key.startswith("mtp."):
            rest[key] = value
            continue
        _, k, suffix = key.split(".", 2)
        layer = args.n_layers + int(k)
        if suffix.startswith("block."):
            rest[f"layers.{layer}.{suffix[len('block.'):]}"] = value
        elif suffix in _MTP_MAP:
            out[f"model.layers.{layer}.{_MTP_MAP[suffix]}"] = value
        else:
            raise KeyError(f"to_hf: unexpected titanlike key {key!r}")
    # The copies of the shared modules, where this (partial) dict has them: real copies, as published (safetensors
    # refuses tensors sharing memory).
    for k in range(args.mtp_num_layers):
        for hf_suffix, ours in _MTP_SHARED.items():
            if ours in state_dict and f"mtp.{k}.eh_proj.weight" in state_dict:
                out[f"model.layers.{args.n_layers + k}.{hf_suffix}"] = state_dict[ours].clone()
    return rest


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """titanlike FQNs -> HF FQNs (hub layout: one tensor per routed expert). Works on partial state dicts (one
    layer, one pipeline stage). Tensors must be full (not sharded DTensors): gather first."""
    out: dict[str, torch.Tensor] = {}
    state_dict = _mtp_to_hf(state_dict, args, out)
    for key, layer, suffix, value in titanlike_layer_items(state_dict, out):
        prefix = f"model.layers.{layer}."
        if suffix in MLP_EXPERTS:
            out.update(unstack_experts(value, f"{prefix}mlp.experts.", f".{MLP_EXPERTS[suffix]}.weight"))
        elif suffix in _LAYER_MAP:
            out[prefix + _LAYER_MAP[suffix]] = value
        else:
            raise KeyError(f"to_hf: unexpected titanlike key {key!r}")
    return out


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """HF FQNs -> titanlike FQNs. The multi-token-prediction modules of DeepSeek-V3 checkpoints (layers n_layers and
    on, which transformers skips) become mtp.<k>.* for the args.mtp_num_layers first of them; the rest are dropped."""
    fp8_scale = next((k for k in hf_state_dict if k.endswith("_scale_inv")), None)
    if fp8_scale is not None:
        raise KeyError(f"from_hf: {fp8_scale!r} is a block-quantized FP8 scale: dequantize the checkpoint to bf16 "
                       f"first (DeepSeek's fp8_cast_bf16.py), then import it")
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}  # titanlike FQN -> expert -> weight
    for key, layer, suffix, value in hf_layer_items(hf_state_dict, out):
        depth = int(layer) - args.n_layers  # >= 0: an MTP module (DeepSeek-V3 publishes one)
        if depth >= args.mtp_num_layers:
            continue
        prefix = f"layers.{layer}."
        if depth >= 0:
            if suffix in _MTP_SHARED:  # copies of the main embedding / output head: the model shares those
                continue
            if suffix in _MTP_MAP_INV:
                out[f"mtp.{depth}.{_MTP_MAP_INV[suffix]}"] = value
                continue
            prefix = f"mtp.{depth}.block."
        if read_mlp_experts(suffix, value, prefix, out, experts):
            continue
        if suffix not in _LAYER_MAP_INV:
            raise KeyError(f"from_hf: unexpected HF key {key!r}")
        out[prefix + _LAYER_MAP_INV[suffix]] = value
    out.update(stack_experts(experts, args.moe.num_experts))
    return out


def args_from_hf_config(config: dict) -> ModelArgs:
    """ModelArgs from a DeepseekV3 config.json dict (the hub's legacy `rope_theta`/`rope_scaling` or transformers
    5's `rope_parameters`)."""
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise ValueError(f"HF config has {flag}=True; titanlike DeepSeek-V3 has no biases")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={config['hidden_act']!r}: only silu (SwiGLU) is supported")
    if config.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"scoring_func={config['scoring_func']!r}: DeepseekV3ForCausalLM routes with sigmoid")
    n_heads = config["num_attention_heads"]
    if config.get("num_key_value_heads") not in (None, n_heads):
        raise ValueError(f"num_key_value_heads={config['num_key_value_heads']} != num_attention_heads={n_heads}: "
                         f"MLA has one key per query head")
    if config.get("rope_interleave", True) is False:
        raise ValueError("rope_interleave=False: weights laid out for half-split RoPE are not supported (titanlike "
                         "and DeepSeek's checkpoints rotate interleaved pairs)")
    if config.get("tie_word_embeddings"):
        raise ValueError("tie_word_embeddings=True: titanlike DeepSeek-V3 keeps a separate output matrix")
    rope, rope_type, rope_theta = hf_rope(config, default_theta=10000.0)
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"unsupported rope_type {rope_type!r} (only default and yarn)")
    if rope.get("attention_factor") is not None or rope.get("truncate", True) is not True:
        raise ValueError("rope_parameters: attention_factor / truncate=False are not supported (DeepSeek's YaRN "
                         "derives the factor from mscale and mscale_all_dim)")
    kw = {}
    if rope_type == "yarn":
        original = int(rope["original_max_position_embeddings"])
        factor = rope.get("factor") or config["max_position_embeddings"] / original
        kw = dict(rope_factor=float(factor), rope_original_max_position=original,
                  rope_beta_fast=float(rope.get("beta_fast") or 32), rope_beta_slow=float(rope.get("beta_slow") or 1),
                  rope_mscale=float(rope.get("mscale") or 0.0), rope_mscale_all_dim=float(rope.get("mscale_all_dim")
                                                                                         or 0.0))
    n_layers = config["num_hidden_layers"]
    moe = MoEArgs(
        num_experts=config["n_routed_experts"], top_k=config["num_experts_per_tok"],
        hidden_dim=config["moe_intermediate_size"], num_shared_experts=config.get("n_shared_experts") or 0,
        score_func="sigmoid", route_norm=bool(config.get("norm_topk_prob", True)),
        route_scale=float(config.get("routed_scaling_factor", 1.0)), n_groups=config.get("n_group") or 1,
        topk_groups=config.get("topk_group") or 1,
        # Training-only, so config.json does not carry them: DeepSeek-V3's recipe (its report), for continued
        # training of an imported model (the auxiliary-loss-free bias is what e_score_correction_bias holds).
        bias_update_rate=1e-3, seq_aux_loss_coeff=1e-4,
    )
    return ModelArgs(
        dim=config["hidden_size"], n_layers=n_layers, n_heads=n_heads, vocab_size=config["vocab_size"],
        max_seq_len=config.get("max_position_embeddings", 4096), norm_eps=config.get("rms_norm_eps", 1e-6),
        q_lora_rank=config.get("q_lora_rank") or 0, kv_lora_rank=config["kv_lora_rank"],
        qk_nope_head_dim=config["qk_nope_head_dim"], qk_rope_head_dim=config["qk_rope_head_dim"],
        v_head_dim=config["v_head_dim"], rope_theta=rope_theta,
        n_dense_layers=min(config.get("first_k_dense_replace") or 0, n_layers),
        dense_hidden_dim=config["intermediate_size"], moe=moe,
        **kw,
    )


def hf_config(args: ModelArgs, dtype: torch.dtype, max_position_embeddings: int | None = None) -> dict:
    """A transformers DeepseekV3Config dict for these ModelArgs (legacy rope keys: read by transformers 4.x and
    5.x). With YaRN, max_position_embeddings is original_max_position_embeddings x factor, whatever is given.
    ValueError for what DeepseekV3ForCausalLM cannot express."""
    m = args.moe
    if args.n_moe_layers and m.score_func != "sigmoid":
        raise ValueError(f"moe.score_func={m.score_func!r}: DeepseekV3ForCausalLM routes with sigmoid only (this "
                         f"flavor follows DeepSeek-V2's softmax routing); it cannot be exported as DeepSeek-V3")
    if args.n_moe_layers and m.num_shared_experts < 1:
        raise ValueError("DeepseekV3ForCausalLM always has shared experts; this model has none")
    if m.shared_hidden_dim not in (0, m.num_shared_experts * m.hidden_dim):
        raise ValueError(f"moe.shared_hidden_dim={m.shared_hidden_dim}: HF sizes the shared experts "
                         f"n_shared_experts * moe_intermediate_size = {m.num_shared_experts * m.hidden_dim}")
    cfg = {
        "architectures": list(ARCHITECTURES[:1]), "model_type": MODEL_TYPES[0], "hidden_act": "silu",
        "hidden_size": args.dim, "intermediate_size": args.dense_hidden_dim, "moe_intermediate_size": m.hidden_dim,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads, "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps,
        "q_lora_rank": args.q_lora_rank or None, "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim, "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim, "n_routed_experts": m.num_experts, "num_experts_per_tok": m.top_k,
        "n_shared_experts": m.num_shared_experts, "first_k_dense_replace": args.n_dense_layers,
        "n_group": m.n_groups, "topk_group": m.topk_groups, "norm_topk_prob": m.route_norm,
        "routed_scaling_factor": m.route_scale, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "rope_interleave": True, "rope_theta": args.rope_theta, "rope_scaling": None,
        "max_position_embeddings": max_position_embeddings or args.max_seq_len, "tie_word_embeddings": False,
        "attention_bias": False, "num_nextn_predict_layers": args.mtp_num_layers,
        "torch_dtype": str(dtype).replace("torch.", ""),
    }
    if args.rope_factor > 1:
        # transformers checks YaRN's factor against max_position_embeddings / original_max_position_embeddings
        # (and warns when they differ): the context YaRN stretches the original one to is original x factor.
        cfg["max_position_embeddings"] = round(args.rope_original_max_position * args.rope_factor)
        cfg["rope_scaling"] = {"type": "yarn", "rope_type": "yarn", "factor": args.rope_factor,
                               "original_max_position_embeddings": args.rope_original_max_position,
                               "beta_fast": args.rope_beta_fast, "beta_slow": args.rope_beta_slow,
                               "mscale": args.rope_mscale, "mscale_all_dim": args.rope_mscale_all_dim}
    return cfg
