"""State-dict adapter between titanlike ViT with the CLIP options (patch_bias=False, pre_norm, final_norm="cls",
quick_gelu) and `transformers`' CLIPVisionModel (n_classes = 0) or CLIPForImageClassification (pool="mean_patches":
a classifier on the patch average). Export writes the hub's names (`vision_model.` first, as openai/clip-* and
llava-hf checkpoints hold them, which both classes load: transformers 5.x strips the prefix for CLIPVisionModel);
import also reads CLIPVisionModel's in-memory names (no prefix) and skips a CLIPModel's text tower and projections.
Not names only: HF's class embedding is [D] (ours [1, 1, D]) and its position table an nn.Embedding [T, D] (ours
[1, T, D]). Pure dict code.
"""
from __future__ import annotations

import torch

from models.common.hf_utils import map_block_key
from models.vit.args import ModelArgs

# the encoder blocks are named as SigLIP's
from models.vit.hf_siglip import _HF_BLOCK, _HF_RE, _LAYER, _LAYER_INV, _PREFIX, _TL_RE, tower_args, tower_config

ARCHITECTURES = ("CLIPForImageClassification", "CLIPVisionModel", "CLIPModel")  # CLIPModel: its vision tower
MODEL_TYPES = ("clip", "clip_vision_model")

_TOP = {
    "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
    "patch_embed.norm.weight": "pre_layrnorm.weight",  # (sic: HF's name)
    "patch_embed.norm.bias": "pre_layrnorm.bias",
    "norm.weight": "post_layernorm.weight",
    "norm.bias": "post_layernorm.bias",
}
_TOP_INV = {v: k for k, v in _TOP.items()}
# ours -> HF's, with the shape change: [1, 1, D] -> [D], [1, T, D] -> [T, D]
_TABLES = {"patch_embed.cls_token": "embeddings.class_embedding", "patch_embed.pos_embed":
           "embeddings.position_embedding.weight"}
_TABLES_INV = {v: k for k, v in _TABLES.items()}
# a CLIPModel checkpoint's other parts: the text tower, the two projections into the joint space, the scale
_NOT_TOWER = ("text_model.", "visual_projection.", "text_projection.", "logit_scale")


def is_clip(args: ModelArgs) -> bool:
    """The CLIP options select this adapter (a class token and the final norm on it alone)."""
    return args.class_token and args.final_norm == "cls"


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key in ("head.weight", "head.bias"):
            out[key.replace("head", "classifier")] = value
        elif key in _TABLES:
            out[_PREFIX + _TABLES[key]] = value.reshape(value.shape[2:] if key.endswith("cls_token")
                                                        else value.shape[-2:])
        elif key in _TOP:
            out[_PREFIX + _TOP[key]] = value
        else:
            out[map_block_key(key, _TL_RE, _LAYER, _PREFIX + _HF_BLOCK, "to_hf")] = value
    return out


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, value in hf_state_dict.items():
        if key.startswith(_NOT_TOWER):
            continue
        if key in ("classifier.weight", "classifier.bias"):
            out[key.replace("classifier", "head")] = value
            continue
        key = key.removeprefix(_PREFIX)
        if key in _TABLES_INV:
            out[_TABLES_INV[key]] = value.reshape(1, -1, value.shape[-1])
        elif key in _TOP_INV:
            out[_TOP_INV[key]] = value
        else:
            out[map_block_key(key, _HF_RE, _LAYER_INV, "layers.{layer}.{name}.{kind}", "from_hf")] = value
    return out


def args_from_hf_config(config: dict) -> ModelArgs:
    """CLIPVisionModel's config, or CLIPForImageClassification's / CLIPModel's (the vision_config inside); defaults
    are CLIPVisionConfig's (openai/clip-vit-base-patch32's)."""
    vision, fields = tower_args(config, "CLIPForImageClassification", patch_size=32, norm_eps=1e-5)
    act = vision.get("hidden_act", "quick_gelu")
    if act not in ("quick_gelu", "gelu"):
        raise ValueError(f"CLIP config hidden_act={act!r}: titanlike's CLIP tower runs 'quick_gelu' or 'gelu'")
    return ModelArgs(**fields, init_std=vision.get("initializer_range", 0.02), act=act, patch_bias=False,
                     pre_norm=True, final_norm="cls", pool="mean_patches", pixel_stats="clip")


def supports(args: ModelArgs) -> bool:
    """HF's CLIP classes: the bare tower, or a classifier on the patch average; the CLIP options all set."""
    return (not args.patch_bias and args.pre_norm and not args.map_head and args.act in ("quick_gelu", "gelu")
            and (not args.n_classes or args.pool == "mean_patches"))


def hf_config(args: ModelArgs, dtype: torch.dtype) -> dict:
    if not supports(args):
        raise ValueError(f"model.args patch_bias={args.patch_bias} pre_norm={args.pre_norm} act={args.act!r} "
                         f"pool={args.pool!r} with final_norm='cls': HF's CLIP classes need patch_bias=false, "
                         f"pre_norm=true, act 'quick_gelu' or 'gelu' and (with classes) pool='mean_patches'")
    return tower_config(args, dtype, "CLIP", "clip", {"initializer_range": args.init_std})
