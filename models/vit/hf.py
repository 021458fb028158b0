"""State-dict adapter between titanlike ViT and Hugging Face `transformers`' ViTForImageClassification (no pooler:
the classifier reads the class token after the final LayerNorm). Every tensor keeps its shape (HF's conv weight,
[1, 1, D] class token, [1, T, D] position table are ours), so the mapping is names only. Pure dict code.
A model with SigLIP's options (class_token=false) goes through models/vit/hf_siglip.py (SiglipVisionModel,
SiglipForImageClassification), one with CLIP's (final_norm="cls") through models/vit/hf_clip.py (CLIPVisionModel,
CLIPForImageClassification): every function here hands them on.
"""
from __future__ import annotations

import re

import torch

from models.common.hf_utils import map_block_key
from models.vit import hf_clip, hf_siglip
from models.vit.args import ModelArgs

ARCHITECTURES = ("ViTForImageClassification", "ViTModel", *hf_siglip.ARCHITECTURES, *hf_clip.ARCHITECTURES)
MODEL_TYPES = ("vit", *hf_siglip.MODEL_TYPES, *hf_clip.MODEL_TYPES)
AUTO_CLASS = "AutoModelForImageClassification"

_TOP = {
    "patch_embed.proj.weight": "vit.embeddings.patch_embeddings.projection.weight",
    "patch_embed.proj.bias": "vit.embeddings.patch_embeddings.projection.bias",
    "patch_embed.cls_token": "vit.embeddings.cls_token",
    "patch_embed.pos_embed": "vit.embeddings.position_embeddings",
    "norm.weight": "vit.layernorm.weight",
    "norm.bias": "vit.layernorm.bias",
    "head.weight": "classifier.weight",
    "head.bias": "classifier.bias",
}
_TOP_INV = {v: k for k, v in _TOP.items()}
_LAYER = {
    "attention_norm": "layernorm_before",
    "attention.wq": "attention.attention.query",
    "attention.wk": "attention.attention.key",
    "attention.wv": "attention.attention.value",
    "attention.wo": "attention.output.dense",
    "ffn_norm": "layernorm_after",
    "feed_forward.w1": "intermediate.dense",
    "feed_forward.w2": "output.dense",
}
# transformers 5.x renames the modules in memory (vit.layers.<i>.attention.q_proj, ...; its files keep the hub
# names above, which export writes): import reads both.
_LAYER_V5 = {"attention.q_proj": "attention.wq", "attention.k_proj": "attention.wk", "attention.v_proj": "attention.wv",
             "attention.o_proj": "attention.wo", "mlp.fc1": "feed_forward.w1", "mlp.fc2": "feed_forward.w2"}
_LAYER_INV = {**{v: k for k, v in _LAYER.items()}, **_LAYER_V5}
_TL_RE = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
_HF_RE = re.compile(r"^vit\.(?:encoder\.layer|layers)\.(\d+)\.(.+)\.(weight|bias)$")


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    if not args.class_token:
        return hf_siglip.to_hf(state_dict, args)
    if hf_clip.is_clip(args):
        return hf_clip.to_hf(state_dict, args)
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key in _TOP:
            out[_TOP[key]] = value
            continue
        out[map_block_key(key, _TL_RE, _LAYER, "vit.encoder.layer.{layer}.{name}.{kind}", "to_hf")] = value
    return out


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    if not args.class_token:
        return hf_siglip.from_hf(hf_state_dict, args)
    if hf_clip.is_clip(args):
        return hf_clip.from_hf(hf_state_dict, args)
    out: dict[str, torch.Tensor] = {}
    for key, value in hf_state_dict.items():
        key = key if key.startswith(("vit.", "classifier.")) else f"vit.{key}"  # ViTModel's names lack "vit."
        if key.startswith("vit.pooler."):
            continue  # ViTModel's optional pooler: not part of the classifier
        if key in _TOP_INV:
            out[_TOP_INV[key]] = value
            continue
        out[map_block_key(key, _HF_RE, _LAYER_INV, "layers.{layer}.{name}.{kind}", "from_hf")] = value
    return out


def args_from_hf_config(config: dict) -> ModelArgs:
    if config.get("model_type") in hf_siglip.MODEL_TYPES or set(config.get("architectures") or []) & set(
            hf_siglip.ARCHITECTURES):
        return hf_siglip.args_from_hf_config(config)
    if config.get("model_type") in hf_clip.MODEL_TYPES or set(config.get("architectures") or []) & set(
            hf_clip.ARCHITECTURES):
        return hf_clip.args_from_hf_config(config)
    if config.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"ViT config hidden_act={config['hidden_act']!r}: titanlike ViT uses the exact GELU ('gelu')")
    if not config.get("qkv_bias", True):
        raise ValueError("ViT config qkv_bias=false: titanlike ViT's q, k, v have biases")
    archs = config.get("architectures") or []
    labels = config.get("id2label") or {}
    n_classes = 0 if archs and archs[0] == "ViTModel" else config.get("num_labels", len(labels) or 2)
    size, channels = config.get("image_size", 224), config.get("num_channels", 3)
    return ModelArgs(dim=config["hidden_size"], n_layers=config["num_hidden_layers"],
                     n_heads=config["num_attention_heads"], ffn_dim=config["intermediate_size"], image_size=size,
                     patch_size=config.get("patch_size", 16), channels=channels, n_classes=n_classes,
                     norm_eps=config.get("layer_norm_eps", 1e-12), init_std=config.get("initializer_range", 0.02),
                     max_seq_len=channels * size * size)


def hf_config(args: ModelArgs, dtype: torch.dtype, max_position_embeddings: int | None = None) -> dict:
    """A transformers ViTConfig dict (max_position_embeddings: unused, the table is the patch grid's)."""
    if not args.class_token:
        return hf_siglip.hf_config(args, dtype)
    if hf_clip.is_clip(args):
        return hf_clip.hf_config(args, dtype)
    if not supports(args):
        raise ValueError(f"model.args act={args.act!r} map_head={args.map_head} pool={args.pool!r} patch_bias="
                         f"{args.patch_bias} pre_norm={args.pre_norm} with a class token: HF's "
                         f"ViTForImageClassification has none of these; set them to 'gelu', false, 'cls', true, false")
    if not args.n_classes:
        raise ValueError("model.args.n_classes=0: a ViT without head exports as ViTModel, which is not written yet; "
                         "give the model a head")
    return {
        "architectures": ["ViTForImageClassification"], "model_type": "vit", "hidden_act": "gelu",
        "hidden_size": args.dim, "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "intermediate_size": args.ffn_dim, "image_size": args.image_size, "patch_size": args.patch_size,
        "num_channels": args.channels, "qkv_bias": True, "layer_norm_eps": args.norm_eps,
        "initializer_range": args.init_std, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
        "id2label": {str(i): f"LABEL_{i}" for i in range(args.n_classes)},
        "label2id": {f"LABEL_{i}": i for i in range(args.n_classes)},
        "torch_dtype": str(dtype).replace("torch.", ""),
    }


def supports(args: ModelArgs) -> bool:
    """False where no HF class holds the model (a SigLIP tower classifying its MAP output, a ViT with some of
    CLIP's options)."""
    if not args.class_token:
        return hf_siglip.supports(args)
    if hf_clip.is_clip(args):
        return hf_clip.supports(args)
    return (args.act == "gelu" and not args.map_head and args.pool == "cls" and args.patch_bias
            and not args.pre_norm)


def example_inputs(tokens: torch.Tensor, args: ModelArgs) -> tuple[torch.Tensor, dict, dict]:
    """(our primary input, our keyword inputs, transformers' inputs) for the same logits: images drawn from the
    tokens' seed-free bytes (the contract test's token rows, tiled to one image each)."""
    g = torch.Generator().manual_seed(int(tokens.sum()))
    pixels = torch.randn(tokens.shape[0], args.channels, args.image_size, args.image_size, generator=g)
    return pixels, {}, {"pixel_values": pixels}
