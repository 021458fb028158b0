"""State-dict and config adapter between titanlike's nemotron_h and transformers' NemotronHForCausalLM. Pure
tensor/dict code (no `transformers` import). models/mamba2/hf.py reuses the renaming with its own prefix.

Names: titanlike keeps HF's block layout (layers.<i>.{norm, mixer}) and the Mamba mixer's names, so only the top
level, the attention (wq/wk/wv/wo <-> q_proj/k_proj/v_proj/o_proj) and the MLP (w1/w2 <-> up_proj/down_proj) are
renamed. One permutation: the Mamba mixer's in_proj rows and conv1d channels are group-major in titanlike (so tensor
parallelism shards whole groups; models/common/mamba2.py) and part-major in transformers; `to_hf_state` and
`from_hf_state` reorder them (NemotronH's attention has no RoPE: nothing else is permuted). The HF prefix is "model."
(transformers 5.x) or "backbone." (the published Nemotron-H checkpoints, transformers' Mamba2); both are read,
"model." is written.
A checkpoint without lm_head (tied) gets a copy of the embedding: titanlike never ties.

MoE ("E") layers: the mixer is models/common/moe.py's MoE; router.gate <-> gate, expert_bias <->
gate.e_score_correction_bias (the selection bias), shared_experts.w1/w2 <-> shared_experts.up_proj/down_proj,
latent_in/latent_out <-> fc1_latent_proj/fc2_latent_proj, and the routed experts stacked (experts.w1/w2 [E, ...]) here,
one tensor per expert in the hub's checkpoints (experts.<e>.up_proj.weight: what to_hf writes, transformers 5.x fuses
them on load) or fused in a 5.x model's own state dict (experts.up_proj / down_proj [E, ...]); from_hf reads both.
"""
from __future__ import annotations

import math
import re

import torch

from models.common.hf_utils import stack_experts, unstack_experts
from models.common.mamba2 import reorder_packed
from models.common.moe_args import MoEArgs
from models.nemotron_h.args import ATTENTION, LETTERS, MAMBA, MLP, MOE, HybridArgs, NemotronHArgs

ARCHITECTURES = ("NemotronHForCausalLM",)
MODEL_TYPES = ("nemotron_h",)

_TOP = {"tok_embeddings.weight": "embeddings.weight", "norm.weight": "norm_f.weight"}
_MIXER = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "w1": "up_proj", "w2": "down_proj"}
_MIXER_INV = {v: k for k, v in _MIXER.items()}
_MAMBA = {"in_proj", "conv1d", "dt_bias", "A_log", "D", "norm", "out_proj"}  # the same names on both sides
_TL_LAYER = re.compile(r"^layers\.(\d+)\.(norm\.weight|mixer\.(\w+)(\..+)?)$")
_HF_KEY = re.compile(r"^(?:model|backbone)\.(.+)$")
# The MoE mixer's tensors: titanlike suffix (after layers.<i>.mixer.) -> HF suffix; the routed experts apart.
_MOE = {"router.gate.weight": "gate.weight", "expert_bias": "gate.e_score_correction_bias",
        "latent_in.weight": "fc1_latent_proj.weight", "latent_out.weight": "fc2_latent_proj.weight",
        "shared_experts.w1.weight": "shared_experts.up_proj.weight",
        "shared_experts.w2.weight": "shared_experts.down_proj.weight"}
_MOE_INV = {v: k for k, v in _MOE.items()}
_EXPERTS = {"experts.w1": "up_proj", "experts.w2": "down_proj"}
_EXPERTS_INV = {v: k for k, v in _EXPERTS.items()}
_MIXER_KEY = re.compile(r"^layers\.(\d+)\.mixer\.(.+)$")
_HF_EXPERT = re.compile(r"^experts\.(\d+)\.(up_proj|down_proj)\.weight$")
# transformers' layers_block_type names (5.x, then the older ones) for the pattern letters
_BLOCK_TYPES = {"linear_attention": MAMBA, "mamba": MAMBA, "full_attention": ATTENTION, "attention": ATTENTION,
                "mlp": MLP, "moe": MOE}


def _rename_mixer(m: re.Match, names: dict[str, str]) -> str:
    """A _TL_LAYER match with the mixer's module renamed by `names` (the rest as it was)."""
    layer, tail, sub = m.group(1), m.group(2), m.group(3)
    if sub is not None and sub not in names and sub not in _MAMBA:
        raise KeyError(f"unexpected mixer parameter {m.group(0)!r}")
    return f"layers.{layer}.{tail}" if sub is None else f"layers.{layer}.mixer.{names.get(sub, sub)}{m.group(4) or ''}"


def rename_to_hf(state_dict: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """titanlike FQNs -> HF FQNs under `prefix` ("model." or "backbone."); full tensors, any subset of keys."""
    out = {}
    for key, value in state_dict.items():
        if key == "output.weight":
            out["lm_head.weight"] = value
        elif key in _TOP:
            out[prefix + _TOP[key]] = value
        elif (m := _MIXER_KEY.match(key)) is not None and m.group(2) in _MOE:
            out[f"{prefix}layers.{m.group(1)}.mixer.{_MOE[m.group(2)]}"] = value
        elif m is not None and m.group(2) in _EXPERTS:
            out.update(unstack_experts(value, f"{prefix}layers.{m.group(1)}.mixer.experts.",
                                       f".{_EXPERTS[m.group(2)]}.weight"))
        elif (m := _TL_LAYER.match(key)) is not None:
            out[prefix + _rename_mixer(m, _MIXER)] = value
        else:
            raise KeyError(f"to_hf: unexpected titanlike key {key!r}")
    return out


def _read_moe(rest: str, value: torch.Tensor, out: dict[str, torch.Tensor],
              per_expert: dict[str, dict[int, torch.Tensor]]) -> bool:
    """One HF layer key (prefix removed) of an MoE mixer into `out` (or `per_expert`, the hub's one tensor per
    expert, for stack_experts); False if it is none."""
    m = _MIXER_KEY.match(rest)
    if m is None:
        return False
    pre, sub = f"layers.{m.group(1)}.mixer.", m.group(2)
    if sub in _MOE_INV:
        out[pre + _MOE_INV[sub]] = value
    elif sub in ("experts.up_proj", "experts.down_proj"):  # transformers 5.x's fused [E, out, in]
        out[pre + _EXPERTS_INV[sub.split(".")[1]]] = value
    elif (em := _HF_EXPERT.match(sub)) is not None:
        per_expert.setdefault(pre + _EXPERTS_INV[em.group(2)], {})[int(em.group(1))] = value
    else:
        return False
    return True


def rename_from_hf(hf_state_dict: dict[str, torch.Tensor], num_experts: int = 0) -> dict[str, torch.Tensor]:
    """HF FQNs ("model." or "backbone." prefix) -> titanlike FQNs; lm_head from the embedding when tied.
    num_experts: the routed experts per MoE layer (config.json's; 0: no MoE layers, whose keys are then refused)."""
    top_inv = {v: k for k, v in _TOP.items()} | {"embedding.weight": "tok_embeddings.weight"}  # Mamba2's old name
    out: dict[str, torch.Tensor] = {}
    per_expert: dict[str, dict[int, torch.Tensor]] = {}
    for key, value in hf_state_dict.items():
        if key == "lm_head.weight":
            out["output.weight"] = value
            continue
        if key.startswith("mtp."):  # multi-token-prediction layers: transformers skips them too (no MTP here)
            continue
        m = _HF_KEY.match(key)
        rest = m.group(1) if m else None
        if rest in top_inv:
            out[top_inv[rest]] = value
        elif rest is not None and num_experts and _read_moe(rest, value, out, per_expert):
            continue
        elif rest is not None and (lm := _TL_LAYER.match(rest)) is not None:
            try:
                out[_rename_mixer(lm, _MIXER_INV)] = value
            except KeyError:
                raise KeyError(f"from_hf: unexpected HF key {key!r}") from None
        else:
            raise KeyError(f"from_hf: unexpected HF key {key!r}")
    out.update(stack_experts(per_expert, num_experts))
    if "output.weight" not in out and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"].clone()
    return out


def _reorder(state_dict: dict[str, torch.Tensor], args: HybridArgs, to_hf: bool) -> dict[str, torch.Tensor]:
    return reorder_packed(state_dict, args.mamba_n_heads, args.mamba_head_dim, args.ssm_state_size, args.n_groups,
                          to_hf=to_hf)


def to_hf_state(state_dict: dict[str, torch.Tensor], args: HybridArgs, prefix: str) -> dict[str, torch.Tensor]:
    """titanlike state dict (full tensors, any subset of keys) -> transformers' names and row order."""
    return rename_to_hf(_reorder(state_dict, args, to_hf=True), prefix)


def from_hf_state(hf_state_dict: dict[str, torch.Tensor], args: HybridArgs) -> dict[str, torch.Tensor]:
    """transformers' state dict -> titanlike's names and row order."""
    moe = getattr(args, "moe", None)
    out = rename_from_hf(hf_state_dict, moe.num_experts if moe is not None and MOE in args.pattern() else 0)
    pattern = args.pattern()
    for key in out:
        m = _MIXER_KEY.match(key)
        if m is not None and (m.group(2) in _MOE or m.group(2) in _EXPERTS):
            layer = int(m.group(1))
            kind = pattern[layer] if layer < len(pattern) else None
            if kind != MOE:
                raise KeyError(f"from_hf: {key!r} is an MoE tensor but layer {layer} is "
                               f"{LETTERS.get(kind, 'past the pattern')} ({kind!r}): the checkpoint and its "
                               f"config.json do not match")
    return _reorder(out, args, to_hf=False)


def to_hf(state_dict: dict[str, torch.Tensor], args: NemotronHArgs) -> dict[str, torch.Tensor]:
    return to_hf_state(state_dict, args, "model.")


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: NemotronHArgs) -> dict[str, torch.Tensor]:
    return from_hf_state(hf_state_dict, args)


def _pattern(config: dict) -> str:
    pattern = config.get("hybrid_override_pattern")
    if pattern:
        return pattern
    types = config.get("layers_block_type") or config.get("layer_types")
    if not types:
        raise ValueError("HF config has neither hybrid_override_pattern nor layers_block_type; cannot tell the "
                         "layer kinds")
    unknown = sorted(set(types) - set(_BLOCK_TYPES))
    if unknown:
        raise ValueError(f"HF config layers_block_type has {unknown}; titanlike's nemotron_h knows {sorted(LETTERS)}")
    return "".join(_BLOCK_TYPES[t] for t in types)


def _refuse(config: dict) -> None:
    acts = {"mlp_hidden_act": "relu2", "mamba_hidden_act": "silu"}
    for key, want in acts.items():
        if config.get(key, want) != want:
            raise ValueError(f"HF config has {key}={config[key]!r}; titanlike's nemotron_h implements {want!r} only")
    if config.get("residual_in_fp32"):
        raise ValueError("HF config has residual_in_fp32=True; titanlike's nemotron_h keeps the residual in the "
                         "activations' dtype")
    if config.get("sliding_window"):
        raise ValueError("HF config has a sliding_window; titanlike's nemotron_h attends over the whole sequence")


def _moe_args(config: dict, pattern: str) -> MoEArgs | None:
    """The MoE layers' args (NemotronHMoE: squared-ReLU experts and one shared expert, sigmoid routing with
    e_score_correction_bias); None without "E" layers."""
    if MOE not in pattern:
        return None
    if config.get("mlp_bias"):
        raise ValueError("HF config has mlp_bias=True with MoE layers; titanlike's MoE has no biases: import a "
                         "checkpoint without them")
    return MoEArgs(
        num_experts=config.get("n_routed_experts", config.get("num_local_experts", 8)),
        top_k=config.get("num_experts_per_tok", 2), hidden_dim=config.get("moe_intermediate_size", 7688),
        num_shared_experts=1, shared_hidden_dim=config.get("moe_shared_expert_intermediate_size", 7688),
        score_func="sigmoid", route_norm=bool(config.get("norm_topk_prob", True)),
        route_scale=float(config.get("routed_scaling_factor", 1.0)), n_groups=config.get("n_group") or 1,
        topk_groups=config.get("topk_group") or 1, expert_act="relu2", latent_dim=config.get("moe_latent_size") or 0,
        # Training-only, so config.json does not carry them: Megatron-Bridge's NemotronH recipe (the expert bias that
        # e_score_correction_bias holds, at Megatron's default rate; the sequence-wise aux loss), for continued
        # training of an imported model.
        bias_update_rate=1e-3, seq_aux_loss_coeff=1e-4)


def args_from_hf_config(config: dict) -> NemotronHArgs:
    """NemotronHArgs from a config.json dict (the published checkpoints' keys, or transformers 5.x's)."""
    _refuse(config)
    pattern = _pattern(config)
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    return NemotronHArgs(
        dim=dim, n_layers=len(pattern), hybrid_override_pattern=pattern, vocab_size=config["vocab_size"],
        max_seq_len=config.get("max_position_embeddings", 4096), norm_eps=config.get("layer_norm_epsilon", 1e-5),
        mamba_n_heads=config["mamba_num_heads"], mamba_head_dim=config["mamba_head_dim"],
        ssm_state_size=config["ssm_state_size"], n_groups=config.get("n_groups", config.get("mamba_n_groups", 8)),
        conv_kernel=config.get("conv_kernel", config.get("mamba_d_conv", 4)),
        chunk_size=config.get("chunk_size", config.get("mamba_chunk_size", 128)),
        dt_min=config.get("time_step_min", 0.001), dt_max=config.get("time_step_max", 0.1),
        dt_floor=config.get("time_step_floor", 1e-4), mamba_bias=bool(config.get("use_bias", False)),
        conv_bias=bool(config.get("use_conv_bias", True)), n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads, head_dim=config.get("head_dim") or dim // n_heads,
        hidden_dim=config["intermediate_size"], attention_bias=bool(config.get("attention_bias", False)),
        mlp_bias=bool(config.get("mlp_bias", False)), moe=_moe_args(config, pattern),
    )


def hf_config(args: NemotronHArgs, dtype: torch.dtype, max_position_embeddings: int | None = None) -> dict:
    """A config.json dict transformers' NemotronHConfig reads (the legacy hybrid_override_pattern key, which 5.x turns
    into layers_block_type)."""
    pattern = args.pattern()
    return {
        "architectures": [ARCHITECTURES[0]], "model_type": MODEL_TYPES[0],
        "vocab_size": args.vocab_size, "hidden_size": args.dim, "num_hidden_layers": args.n_layers,
        "hybrid_override_pattern": pattern, "tie_word_embeddings": False,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "attention_bias": args.attention_bias, "intermediate_size": args.hidden_dim, "mlp_hidden_act": "relu2",
        "mlp_bias": args.mlp_bias, "mamba_num_heads": args.mamba_n_heads, "mamba_head_dim": args.mamba_head_dim,
        "ssm_state_size": args.ssm_state_size, "n_groups": args.n_groups, "conv_kernel": args.conv_kernel,
        "chunk_size": args.chunk_size, "mamba_hidden_act": "silu", "use_bias": args.mamba_bias,
        "use_conv_bias": args.conv_bias, "time_step_min": args.dt_min, "time_step_max": args.dt_max,
        "time_step_floor": args.dt_floor, "time_step_limit": [0.0, math.inf], "layer_norm_epsilon": args.norm_eps,
        "residual_in_fp32": False, "max_position_embeddings": max_position_embeddings or args.max_seq_len,
        "torch_dtype": str(dtype).replace("torch.", ""), "num_nextn_predict_layers": 0,
        **(_moe_config(args) if MOE in pattern else {}),
    }


def _moe_config(args: NemotronHArgs) -> dict:
    """config.json's MoE keys; ValueError for an MoE NemotronHMoE cannot express (one line naming the key)."""
    m = args.moe
    want = {"score_func": "sigmoid", "expert_act": "relu2"}
    for key, value in want.items():
        if getattr(m, key) != value:
            raise ValueError(f"hf_config: model.args.moe.{key}={getattr(m, key)!r}, but NemotronHMoE has {value!r} "
                             f"only; this model cannot be exported as NemotronHForCausalLM")
    if m.num_shared_experts < 1:
        raise ValueError("hf_config: model.args.moe.num_shared_experts=0, but NemotronHMoE always has a shared "
                         "expert; this model cannot be exported as NemotronHForCausalLM")
    if args.mlp_bias:
        raise ValueError("hf_config: model.args.mlp_bias=True would give NemotronHMoE's shared expert biases that "
                         "titanlike's MoE has not; export with mlp_bias=False")
    return {"n_routed_experts": m.num_experts, "num_experts_per_tok": m.top_k, "moe_intermediate_size": m.hidden_dim,
            "n_shared_experts": m.num_shared_experts,
            "moe_shared_expert_intermediate_size": m.shared_hidden_dim or m.num_shared_experts * m.hidden_dim,
            "moe_latent_size": m.latent_dim or None, "routed_scaling_factor": m.route_scale,
            "n_group": m.n_groups, "topk_group": m.topk_groups, "norm_topk_prob": m.route_norm}
