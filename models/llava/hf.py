"""State-dict adapter between titanlike LLaVA and transformers' LlavaForConditionalGeneration with a ViT tower
(vision_config: ViTConfig, AutoModel -> ViTModel), a SigLIP tower (SiglipVisionConfig -> SiglipVisionModel: the
vit family with class_token=False) or a CLIP tower (CLIPVisionConfig -> CLIPVisionModel, LLaVA-1.5's: the vit family
with final_norm="cls") and a decoder family's text_config (LlamaConfig, Qwen3Config, ...).
The tower's and the language model's tensors go through their own families' adapters (RoPE row permutations
included); this file only moves prefixes. Pure dict code (no transformers import).

Export writes the hub layout of llava-hf checkpoints (vision_tower.*, multi_modal_projector.*,
language_model.model.*, language_model.lm_head.*), which transformers 4.x and 5.x load; import also reads 5.x's
in-memory names (model.vision_tower.*, model.language_model.*, lm_head.*). What HF holds but never reaches the
logits (tower blocks past vision_feature_layer, the tower's final LayerNorm, ViTModel's pooler; SigLIP's and CLIP's
post_layernorm, SigLIP's MAP head) is dropped on import and written as zeros (LayerNorm: ones) on export (a SigLIP tower
is exported with vision_use_head=false), so the folder is complete and computes our logits.
"""
from __future__ import annotations

import dataclasses

import torch

from models.llava.args import ModelArgs
from models.vit import hf as vit_hf
from models.vit import hf_clip, hf_siglip

ARCHITECTURES = ("LlavaForConditionalGeneration",)
MODEL_TYPES = ("llava",)
AUTO_CLASS = "AutoModelForImageTextToText"

_VISION = ("model.vision_tower.", "vision_tower.")
_PROJ = ("model.multi_modal_projector.", "multi_modal_projector.")
_LANG = {"model.language_model.": "model.", "language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
         "lm_head.": "lm_head."}


def supports(args: ModelArgs) -> bool:
    """False: the shared contract test (tests/unit/test_model_contract.py) compares parameter counts with
    transformers', which hold the unused tower parts; tests/unit/test_llava.py checks this adapter instead."""
    return False


def _lang_spec(args: ModelArgs):
    from models.llava import families

    return families.language(args.language_family)


def _hub_tower(v) -> bool:
    """SigLIP's and CLIP's towers share HF's layout (vision_model.{embeddings, encoder.layers.<i>.{layer_norm1,
    self_attn.*, mlp.*}, post_layernorm}); ViT's is ViTModel's."""
    return not v.class_token or hf_clip.is_clip(v)


def _split(key: str, prefixes) -> str | None:
    return next((key[len(p):] for p in prefixes if key.startswith(p)), None)


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    vision, lang, out = {}, {}, {}
    for key, value in state_dict.items():
        if key.startswith("vision."):
            vision[key[len("vision."):]] = value
        elif key.startswith("projector."):
            out["multi_modal_projector." + key[len("projector."):]] = value
        else:
            lang[key] = value
    for key, value in vit_hf.to_hf(vision, args.vision).items():  # ViT: vit.*; SigLIP, CLIP: vision_model.*
        out["vision_tower." + key.removeprefix("vit.")] = value
    out.update(_unused_tower(args, next(iter(state_dict.values())).dtype))
    for key, value in _lang_spec(args).hf.to_hf(lang, args.text_args).items():
        out["language_model." + key] = value  # model.* and lm_head.*
    return out


def _unused_tower(args: ModelArgs, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    v, d = args.vision, args.vision.dim
    if _hub_tower(v):
        return _unused_siglip(args, dtype)
    out = {"vision_tower.layernorm.weight": torch.ones(d, dtype=dtype),
           "vision_tower.layernorm.bias": torch.zeros(d, dtype=dtype),
           "vision_tower.pooler.dense.weight": torch.zeros(d, d, dtype=dtype),
           "vision_tower.pooler.dense.bias": torch.zeros(d, dtype=dtype)}
    shapes = {"attention.attention.query": (d, d), "attention.attention.key": (d, d),
              "attention.attention.value": (d, d), "attention.output.dense": (d, d), "layernorm_before": (d,),
              "layernorm_after": (d,), "intermediate.dense": (v.ffn_dim, d), "output.dense": (d, v.ffn_dim)}
    for j in range(args.vision_layers_used, v.n_layers):
        for name, shape in shapes.items():
            out[f"vision_tower.encoder.layer.{j}.{name}.weight"] = torch.zeros(shape, dtype=dtype)
            out[f"vision_tower.encoder.layer.{j}.{name}.bias"] = torch.zeros(shape[0], dtype=dtype)
    return out


def _unused_siglip(args: ModelArgs, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """SigLIP's and CLIP's (the same names and shapes)."""
    v, d, pre = args.vision, args.vision.dim, "vision_tower.vision_model."
    out = {pre + "post_layernorm.weight": torch.ones(d, dtype=dtype),
           pre + "post_layernorm.bias": torch.zeros(d, dtype=dtype)}
    shapes = {"self_attn.q_proj": (d, d), "self_attn.k_proj": (d, d), "self_attn.v_proj": (d, d),
              "self_attn.out_proj": (d, d), "layer_norm1": (d,), "layer_norm2": (d,), "mlp.fc1": (v.ffn_dim, d),
              "mlp.fc2": (d, v.ffn_dim)}
    for j in range(args.vision_layers_used, v.n_layers):
        for name, shape in shapes.items():
            ones = name.startswith("layer_norm")
            out[f"{pre}encoder.layers.{j}.{name}.weight"] = (torch.ones if ones else torch.zeros)(shape, dtype=dtype)
            out[f"{pre}encoder.layers.{j}.{name}.bias"] = torch.zeros(shape[0], dtype=dtype)
    return out


def _tower_key(rest: str, siglip: bool) -> str | None:
    """A tower key (after vision_tower.) as the vit adapter reads it; None for what never reaches the features."""
    if siglip:  # SigLIP, CLIP. hub files: vision_model.*; transformers 5.x in memory: no prefix
        return None if rest.removeprefix("vision_model.").startswith(("post_layernorm.", "head.")) else rest
    return None if rest.startswith(("layernorm.", "pooler.")) else "vit." + rest


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    vision, lang, out = {}, {}, {}
    used = args.vision_layers_used
    for key, value in hf_state_dict.items():
        if (rest := _split(key, _VISION)) is not None:
            if (name := _tower_key(rest, _hub_tower(args.vision))) is not None:
                vision[name] = value
        elif (rest := _split(key, _PROJ)) is not None:
            out["projector." + rest] = value
        elif (new := next((n for p, n in _LANG.items() if key.startswith(p)), None)) is not None:
            lang[new + key[len(next(p for p in _LANG if key.startswith(p))):]] = value
        else:
            raise KeyError(f"from_hf: unexpected LLaVA key {key!r}")
    for key, value in vit_hf.from_hf(vision, args.vision).items():
        if key.startswith("layers.") and int(key.split(".")[1]) >= used:
            continue  # past the feature layer
        out["vision." + key] = value
    lang_sd = _lang_spec(args).hf.from_hf(lang, args.text_args)
    return {**lang_sd, **out}


def args_from_hf_config(config: dict) -> ModelArgs:
    from models.llava import families

    vc, tc = dict(config["vision_config"]), dict(config["text_config"])
    if vc.get("model_type", "vit") not in ("vit", *hf_siglip.MODEL_TYPES, *hf_clip.MODEL_TYPES):
        raise ValueError(f"LLaVA vision_config model_type={vc.get('model_type')!r}: only ViT ('vit'), SigLIP "
                         f"('siglip_vision_model') and CLIP ('clip_vision_model') towers are supported")
    family = next((n for n, s in families.LANGUAGE.items() if tc.get("model_type") in s.hf.MODEL_TYPES), None)
    if family is None:
        raise ValueError(f"LLaVA text_config model_type={tc.get('model_type')!r}: no titanlike decoder family reads it")
    layer = config.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise ValueError(f"LLaVA vision_feature_layer={layer}: several feature layers are not supported")
    if vc.get("model_type", "vit") == "vit":
        vision = vit_hf.args_from_hf_config({**vc, "architectures": ["ViTModel"]})
    elif vc["model_type"] in hf_clip.MODEL_TYPES:  # llava-hf/llava-1.5-*: CLIP ViT-L/14-336
        vision = hf_clip.args_from_hf_config({**vc, "architectures": ["CLIPVisionModel"]})
    else:  # the tower without its MAP head: llava reads hidden states, never the pooler
        vision = dataclasses.replace(hf_siglip.args_from_hf_config({**vc, "architectures": ["SiglipVisionModel"]}),
                                     n_classes=0, map_head=False)
    text = families.language(family).hf.args_from_hf_config(tc)
    token = config.get("image_token_id", config.get("image_token_index"))
    return ModelArgs(vision=vision, language_family=family, text=text, vocab_size=text.vocab_size,
                     max_seq_len=text.max_seq_len, n_layers=text.n_layers, vision_feature_layer=layer,
                     vision_feature_select_strategy=config.get("vision_feature_select_strategy", "default"),
                     projector_act=config.get("projector_hidden_act", "gelu"),
                     projector_bias=config.get("multimodal_projector_bias", True), image_token_id=token)


def hf_config(args: ModelArgs, dtype: torch.dtype, max_position_embeddings: int | None = None) -> dict:
    if not _hub_tower(args.vision):
        vision = vit_hf.hf_config(dataclasses.replace(args.vision, n_classes=1), dtype)
        for k in ("id2label", "label2id"):
            vision.pop(k)
        vision["architectures"] = ["ViTModel"]
    else:  # SiglipVisionModel's config (no head: what llava-hf's SigLIP checkpoints hold too), CLIPVisionModel's
        vision = vit_hf.hf_config(dataclasses.replace(args.vision, n_classes=0, map_head=False), dtype)
    text = _lang_spec(args).hf.hf_config(args.text_args, dtype, max_position_embeddings)
    return {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "vision_config": vision,
            "text_config": text, "image_token_id": args.image_token, "image_token_index": args.image_token,
            "vision_feature_layer": args.vision_feature_layer,
            "vision_feature_select_strategy": args.vision_feature_select_strategy,
            "projector_hidden_act": args.projector_act, "multimodal_projector_bias": args.projector_bias,
            "tie_word_embeddings": False, "torch_dtype": str(dtype).replace("torch.", "")}


def preprocessor_config(args: ModelArgs) -> dict:
    """The image processor's settings (preprocessor_config.json beside an export): the normalisation training used
    (the tower's pixel_stats, models/vit/args.py) at the tower's size, with the resampling of the tower's HF
    processor (ViT: bilinear, SigLIP and CLIP: bicubic). titanlike/infer/images.py reads the same file of an HF
    folder. CLIP's processor center-crops by default: off here (the resize already gives the tower's size)."""
    v = args.vision
    vit = not _hub_tower(v)
    proc = "ViTImageProcessor" if vit else "CLIPImageProcessor" if v.class_token else "SiglipImageProcessor"
    out = {"image_processor_type": proc, "do_resize": True, "size": {"height": v.image_size, "width": v.image_size},
           "resample": 2 if vit else 3, "do_rescale": True, "rescale_factor": 1 / 255,
           "do_normalize": True, "image_mean": list(v.mean_std[0]), "image_std": list(v.mean_std[1])}
    return out if proc != "CLIPImageProcessor" else {**out, "do_center_crop": False, "do_convert_rgb": True}


IMAGE_TEXT = "<image>"  # the placeholder's text in llava-hf tokenizers and LlavaProcessor's default


def tokenizer_tokens(args: ModelArgs) -> dict[str, int]:
    """Special tokens an export's tokenizer must hold at the model's ids: LlavaProcessor finds the placeholder id by
    encoding "<image>"."""
    return {IMAGE_TEXT: args.image_token}


def processor_config(args: ModelArgs) -> dict:
    """processor_config.json: LlavaProcessor expands each "<image>" to (size / patch)^2 + num_additional_image_tokens
    placeholders, less one with strategy "default": args.image_tokens (the class token counts as the additional
    one)."""
    v = args.vision
    return {"processor_class": "LlavaProcessor", "image_token": IMAGE_TEXT, "patch_size": v.patch_size,
            "num_additional_image_tokens": int(v.class_token),
            "vision_feature_select_strategy": args.vision_feature_select_strategy}
