"""State-dict adapter between titanlike ViT with the SigLIP options (class_token=False, the MAP head) and
`transformers`' SiglipVisionModel (n_classes = 0) or SiglipForImageClassification (pool="mean": a classifier on the
token average). Export writes the hub's names (`vision_model.` first, as google/siglip-* checkpoints, which both
classes load); import also reads SiglipVisionModel's in-memory names (no prefix) and skips a SiglipModel's text tower.
Not names only: HF's position table is an nn.Embedding [T, D] (ours [1, T, D]) and its MAP attention is
nn.MultiheadAttention with q, k, v fused in one in_proj (ours three Linears). Pure dict code.
"""
from __future__ import annotations

import re

import torch

from models.common.hf_utils import map_block_key
from models.vit.args import ModelArgs

ARCHITECTURES = ("SiglipForImageClassification", "SiglipVisionModel", "SiglipModel")  # SiglipModel: its tower
MODEL_TYPES = ("siglip", "siglip_vision_model")

_TOP = {
    "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
    "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
    "norm.weight": "post_layernorm.weight",
    "norm.bias": "post_layernorm.bias",
    "map_head.probe": "head.probe",
    "map_head.attention.wo.weight": "head.attention.out_proj.weight",
    "map_head.attention.wo.bias": "head.attention.out_proj.bias",
    "map_head.norm.weight": "head.layernorm.weight",
    "map_head.norm.bias": "head.layernorm.bias",
    "map_head.feed_forward.w1.weight": "head.mlp.fc1.weight",
    "map_head.feed_forward.w1.bias": "head.mlp.fc1.bias",
    "map_head.feed_forward.w2.weight": "head.mlp.fc2.weight",
    "map_head.feed_forward.w2.bias": "head.mlp.fc2.bias",
}
_TOP_INV = {v: k for k, v in _TOP.items()}
_POS, _HF_POS = "patch_embed.pos_embed", "embeddings.position_embedding.weight"
_QKV = ("map_head.attention.wq", "map_head.attention.wk", "map_head.attention.wv")
# The block names of SigLIP's and CLIP's HF encoders (the same; hf_clip.py imports them)
_LAYER = {
    "attention_norm": "layer_norm1", "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.out_proj", "ffn_norm": "layer_norm2",
    "feed_forward.w1": "mlp.fc1", "feed_forward.w2": "mlp.fc2",
}
_LAYER_INV = {v: k for k, v in _LAYER.items()}
_TL_RE = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
_HF_RE = re.compile(r"^encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_PREFIX = "vision_model."
_HF_BLOCK = "encoder.layers.{layer}.{name}.{kind}"


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key in ("head.weight", "head.bias"):
            out[key.replace("head", "classifier")] = value
        elif key == _POS:
            out[_PREFIX + _HF_POS] = value.reshape(value.shape[-2:])
        elif key in _TOP:
            out[_PREFIX + _TOP[key]] = value
        elif key.startswith(_QKV):
            continue  # fused below
        else:
            out[map_block_key(key, _TL_RE, _LAYER, _PREFIX + _HF_BLOCK, "to_hf")] = value
    if args.map_head:
        for kind in ("weight", "bias"):
            parts = [state_dict.get(f"{q}.{kind}") for q in _QKV]
            if all(p is not None for p in parts):  # a partial dict (one key, as the PEFT probe sends) has no in_proj
                out[f"{_PREFIX}head.attention.in_proj_{kind}"] = torch.cat(parts)
    return out


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, value in hf_state_dict.items():
        if key.startswith("text_model.") or key in ("logit_scale", "logit_bias"):
            continue  # a SiglipModel checkpoint: the text tower and the contrastive scale are not the vision tower's
        if key in ("classifier.weight", "classifier.bias"):
            out[key.replace("classifier", "head")] = value
            continue
        key = key.removeprefix(_PREFIX)
        if key == _HF_POS:
            out[_POS] = value.unsqueeze(0)
        elif key in _TOP_INV:
            out[_TOP_INV[key]] = value
        elif key.startswith("head.attention.in_proj_"):
            kind = key.rsplit("_", 1)[1]
            out.update({f"{q}.{kind}": t for q, t in zip(_QKV, value.chunk(3))})
        else:
            out[map_block_key(key, _HF_RE, _LAYER_INV, "layers.{layer}.{name}.{kind}", "from_hf")] = value
    return out


def tower_args(config: dict, classifier: str, patch_size: int, norm_eps: float) -> tuple[dict, dict]:
    """(the vision config, the ModelArgs fields every HF vision tower config gives) from a tower's own config or a
    classifier's / joint model's (the vision_config inside); `classifier` the architecture that has classes; the
    defaults are the family's config class's, for keys a config leaves out. SigLIP's and CLIP's adapters share it."""
    vision = config.get("vision_config", config)
    archs = config.get("architectures") or []
    labels = config.get("id2label") or {}
    n_classes = config.get("num_labels", len(labels) or 2) if archs and archs[0] == classifier else 0
    size, channels = vision.get("image_size", 224), vision.get("num_channels", 3)
    return vision, dict(dim=vision.get("hidden_size", 768), n_layers=vision.get("num_hidden_layers", 12),
                        n_heads=vision.get("num_attention_heads", 12), ffn_dim=vision.get("intermediate_size", 3072),
                        image_size=size, patch_size=vision.get("patch_size", patch_size), channels=channels,
                        n_classes=n_classes, norm_eps=vision.get("layer_norm_eps", norm_eps),
                        max_seq_len=channels * size * size)


def args_from_hf_config(config: dict) -> ModelArgs:
    """SiglipVisionModel's config, or SiglipForImageClassification's / SiglipModel's (the vision_config inside)."""
    vision, fields = tower_args(config, "SiglipForImageClassification", patch_size=16, norm_eps=1e-6)
    return ModelArgs(**fields, class_token=False, act=vision.get("hidden_act", "gelu_pytorch_tanh"),
                     map_head=vision.get("vision_use_head", True), pool="mean")


def supports(args: ModelArgs) -> bool:
    """HF has no class with a classifier on the MAP output (pool="map" with classes)."""
    return not args.n_classes or args.pool == "mean"


def hf_config(args: ModelArgs, dtype: torch.dtype) -> dict:
    if not supports(args):
        raise ValueError(f"model.args.pool={args.pool!r} with n_classes={args.n_classes}: HF's "
                         f"SiglipForImageClassification classifies the token average; set model.args.pool='mean' to "
                         f"export, or n_classes=0 for the bare SiglipVisionModel")
    return tower_config(args, dtype, "Siglip", "siglip", {"vision_use_head": args.map_head})


def tower_config(args: ModelArgs, dtype: torch.dtype, cls: str, model_type: str, extra: dict) -> dict:
    """The HF config of a vision tower (`{cls}VisionModel`, n_classes = 0) or its classifier
    (`{cls}ForImageClassification`, the tower's config inside); `extra`: the family's own vision keys. SigLIP's and
    CLIP's adapters share it."""
    vision = {"model_type": f"{model_type}_vision_model", "hidden_size": args.dim, "num_hidden_layers": args.n_layers,
              "num_attention_heads": args.n_heads, "intermediate_size": args.ffn_dim, "image_size": args.image_size,
              "patch_size": args.patch_size, "num_channels": args.channels, "hidden_act": args.act,
              "layer_norm_eps": args.norm_eps, "attention_dropout": 0.0, **extra}
    dtype_name = str(dtype).replace("torch.", "")
    if not args.n_classes:
        return {"architectures": [f"{cls}VisionModel"], **vision, "torch_dtype": dtype_name}
    return {"architectures": [f"{cls}ForImageClassification"], "model_type": model_type, "vision_config": vision,
            "id2label": {str(i): f"LABEL_{i}" for i in range(args.n_classes)},
            "label2id": {f"LABEL_{i}": i for i in range(args.n_classes)}, "torch_dtype": dtype_name}
