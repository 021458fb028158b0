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
"""
from __future__ import annotations

import math
import re

import torch

from models.common.mamba2 import reorder_packed
from models.nemotron_h.args import ATTENTION, LETTERS, MAMBA, MLP, MOE, HybridArgs, NemotronHArgs

ARCHITECTURES = ("NemotronHForCausalLM",)
MODEL_TYPES = ("nemotron_h",)

_TOP = {"tok_embeddings.weight": "embeddings.weight", "norm.weight": "norm_f.weight"}
_MIXER = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "w1": "up_proj", "w2": "down_proj"}
_MIXER_INV = {v: k for k, v in _MIXER.items()}
_MAMBA = {"in_proj", "conv1d", "dt_bias", "A_log", "D", "norm", "out_proj"}  # the same names on both sides
_TL_LAYER = re.compile(r"^layers\.(\d+)\.(norm\.weight|mixer\.(\w+)(\..+)?)$")
_HF_KEY = re.compile(r"^(?:model|backbone)\.(.+)$")
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
        elif (m := _TL_LAYER.match(key)) is not None:
            out[prefix + _rename_mixer(m, _MIXER)] = value
        else:
            raise KeyError(f"to_hf: unexpected titanlike key {key!r}")
    return out


def rename_from_hf(hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF FQNs ("model." or "backbone." prefix) -> titanlike FQNs; lm_head from the embedding when tied."""
    top_inv = {v: k for k, v in _TOP.items()} | {"embedding.weight": "tok_embeddings.weight"}  # Mamba2's old name
    out = {}
    for key, value in hf_state_dict.items():
        if key == "lm_head.weight":
            out["output.weight"] = value
            continue
        m = _HF_KEY.match(key)
        rest = m.group(1) if m else None
        if rest in top_inv:
            out[top_inv[rest]] = value
        elif rest is not None and (lm := _TL_LAYER.match(rest)) is not None:
            try:
                out[_rename_mixer(lm, _MIXER_INV)] = value
            except KeyError:
                raise KeyError(f"from_hf: unexpected HF key {key!r}") from None
        else:
            raise KeyError(f"from_hf: unexpected HF key {key!r}")
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
    return _reorder(rename_from_hf(hf_state_dict), args, to_hf=False)


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
        mlp_bias=bool(config.get("mlp_bias", False)),
    )


def hf_config(args: NemotronHArgs, dtype: torch.dtype, max_position_embeddings: int | None = None) -> dict:
    """A config.json dict transformers' NemotronHConfig reads (the legacy hybrid_override_pattern key, which 5.x turns
    into layers_block_type)."""
    pattern = args.pattern()
    if MOE in pattern:
        raise ValueError("hf_config: 'E' (MoE) layers are not implemented in titanlike's nemotron_h")
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
        "torch_dtype": str(dtype).replace("torch.", ""),
    }
