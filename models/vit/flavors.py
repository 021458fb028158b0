"""ViT flavors: the published sizes (Dosovitskiy et al. 2020; HF google/vit-{base,large}-patch16-224,
google/vit-huge-patch14-224-in21k), 224 x 224 RGB, ImageNet-1k's 1000 classes; and SigLIP's vision towers (Zhai et
al. 2023; HF google/siglip-base-patch16-224, google/siglip-so400m-patch14-384: LayerNorm eps 1e-6) with the MAP
head and a 1000-class classifier on the token average, as HF's SiglipForImageClassification; and CLIP's vision
tower (Radford et al. 2021; HF openai/clip-vit-large-patch14-336, LLaVA-1.5's tower) as HF's CLIPVisionModel."""
from __future__ import annotations

from models.vit.args import ModelArgs


def _vit(dim: int, n_layers: int, n_heads: int, patch: int) -> ModelArgs:
    return ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, ffn_dim=4 * dim, image_size=224, patch_size=patch,
                     n_classes=1000)


def _siglip(dim: int, n_layers: int, n_heads: int, ffn_dim: int, image: int, patch: int, **kw) -> ModelArgs:
    return ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, ffn_dim=ffn_dim, image_size=image, patch_size=patch,
                     norm_eps=1e-6, class_token=False, act="gelu_pytorch_tanh", map_head=True, pool="mean",
                     max_seq_len=3 * image * image, **kw)


def _clip(dim: int, n_layers: int, n_heads: int, ffn_dim: int, image: int, patch: int, **kw) -> ModelArgs:
    """CLIPVisionConfig's openai values: quick_gelu, LayerNorm eps 1e-5, initializer_range 0.02; no patch bias,
    pre_layrnorm, post_layernorm on the class token. Without classes (n_classes=0): the bare tower (CLIPVisionModel)."""
    return ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, ffn_dim=ffn_dim, image_size=image, patch_size=patch,
                     norm_eps=1e-5, act="quick_gelu", patch_bias=False, pre_norm=True, final_norm="cls",
                     pool="mean_patches", pixel_stats="clip", max_seq_len=3 * image * image, **kw)


vit_flavors: dict[str, ModelArgs] = {
    # CPU tests and smoke runs: 32 x 32 images in 8 x 8 patches (16 patches + the class token), the synthetic
    # shapes set's 10 classes (titanlike/data/images.py).
    "debugmodel": ModelArgs(dim=64, n_layers=2, n_heads=4, ffn_dim=256, image_size=32, patch_size=8, n_classes=10,
                            max_seq_len=3 * 32 * 32),
    "B/16": _vit(768, 12, 12, 16),  # 86.6M
    "L/16": _vit(1024, 24, 16, 16),  # 304M
    "H/14": _vit(1280, 32, 16, 14),  # 632M
    # CLIP at the debug size: 16 patches + the class token, 10 classes on the patch average
    # (CLIPForImageClassification's classifier), so the shapes set trains it and the contract exports it. (Before
    # SigLIP's: the contract's fake-rank plan test shards a family's last debug flavor, debug-siglip with its MAP
    # head; tests/unit/test_vit.py shards debug-clip.)
    "debug-clip": _clip(64, 2, 4, 256, 32, 8, n_classes=10),
    # openai/clip-vit-large-patch14-336's vision_config (LLaVA-1.5's tower): hidden 1024, 24 layers, 16 heads,
    # intermediate 4096, patch 14 at 336 (24 x 24 = 576 patches + the class token), quick_gelu, eps 1e-5. The bare
    # tower: 303.5M (HF CLIPVisionModel, without CLIPModel's visual_projection).
    "L/14-336-clip": _clip(1024, 24, 16, 4096, 336, 14, n_classes=0),
    # SigLIP at the debug size: 16 patches (no class token), the MAP head, 10 classes on the token average.
    "debug-siglip": _siglip(64, 2, 4, 256, 32, 8, n_classes=10),
    "siglip-B/16-224": _siglip(768, 12, 12, 3072, 224, 16),  # 92.9M tower + classifier
    "siglip-so400m/14-384": _siglip(1152, 27, 16, 4304, 384, 14),  # 27 x 27 patches (384 // 14; HF's valid conv)
}
