"""LLaVA flavors: a vision family's args + a decoder family's args (their own flavors, so sizes stay defined once)."""
from __future__ import annotations

import dataclasses

from models.llama3.flavors import llama3_flavors
from models.llava.args import ModelArgs
from models.vit.args import ModelArgs as ViTArgs
from models.vit.flavors import vit_flavors


def _llava(vision: ViTArgs, text, **kw) -> ModelArgs:
    return ModelArgs(vision=dataclasses.replace(vision, n_classes=0), text=text, n_layers=text.n_layers,
                     vocab_size=text.vocab_size, max_seq_len=text.max_seq_len, **kw)


# ViT-L/14 at 336 px in LLaVA-1.5's CLIP tower's shapes (576 patches), as an HF ViT (kept for the "1B" flavor's
# checkpoints; "1B-clip" is the CLIP tower itself: pre-LN on the embeddings, quick-GELU, no patch bias).
_VIT_L14_336 = dataclasses.replace(vit_flavors["L/16"], patch_size=14, image_size=336, n_classes=0)


def _siglip(name: str, **kw) -> ViTArgs:
    """A models/vit SigLIP flavor as a tower: no MAP head (HF's llava reads hidden_states, never the pooler)."""
    return dataclasses.replace(vit_flavors[name], n_classes=0, map_head=False, **kw)


llava_flavors: dict[str, ModelArgs] = {
    # CPU tests and smoke runs: the debug ViT (32x32, 8x8 patches: 16 placeholders an image) with 3 blocks (the
    # feature layer -2 uses 2) and the debug Llama.
    "debugmodel": _llava(dataclasses.replace(vit_flavors["debugmodel"], n_layers=3), llama3_flavors["debugmodel"]),
    # 1B-class: ViT-L/14-336 + Llama 3.2 1B shapes (untied output, see models/llama3/flavors.py).
    "1B": _llava(_VIT_L14_336, llama3_flavors["1B"]),
    # The debug SigLIP tower (3 blocks, 2 used; 16 patches, no class token) with strategy "full", as llava-hf's
    # SigLIP-based checkpoints: every token is a feature, 16 placeholders an image (shapes_captions' layout).
    "debug-siglip": _llava(_siglip("debug-siglip", n_layers=3), llama3_flavors["debugmodel"],
                           vision_feature_select_strategy="full"),
    # SigLIP so400m/14-384 (27 x 27 = 729 patches, all 27 blocks: feature layer -1, strategy "full", as llava-hf's
    # llava-interleave / llava-onevision) + Llama 3.2 1B shapes.
    "1B-siglip": _llava(_siglip("siglip-so400m/14-384"), llama3_flavors["1B"], vision_feature_layer=-1,
                        vision_feature_select_strategy="full"),
    # The debug CLIP tower (3 blocks, 2 used; 16 patches + the class token) with LLaVA-1.5's feature layer -2 and
    # strategy "default" (the class token dropped): 16 placeholders an image, as the debug ViT's.
    "debug-clip": _llava(dataclasses.replace(vit_flavors["debug-clip"], n_layers=3), llama3_flavors["debugmodel"]),
    # LLaVA-1.5's tower (llava-hf/llava-1.5-7b-hf: CLIP ViT-L/14-336, feature layer -2, "default": 576 image
    # tokens) + Llama 3.2 1B shapes (LLaVA-1.5 itself uses Vicuna 7B / 13B).
    "1B-clip": _llava(vit_flavors["L/14-336-clip"], llama3_flavors["1B"]),
}
