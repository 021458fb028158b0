"""ViT model arguments (named sizes in flavors.py; run knobs live in configs/)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Per-channel (mean, std) of the pixels after scaling to 0..1, by name (model.args.pixel_stats): what the tower's HF
# image processor normalises with. "half": HF's ViT and SigLIP processors (0.5, 0.5); "clip": OpenAI CLIP's
# (CLIPImageProcessor's defaults, LLaVA-1.5's); "imagenet": torchvision's / timm's ImageNet statistics.
PIXEL_STATS = {
    "half": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    "clip": ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}


@dataclass
class ModelArgs:
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    ffn_dim: int = 3072  # HF's intermediate_size
    image_size: int = 224
    patch_size: int = 16
    channels: int = 3
    n_classes: int = 1000  # the classifier's outputs (HF's num_labels)
    norm_eps: float = 1e-12  # HF ViTConfig's layer_norm_eps (google/vit-*)
    init_std: float = 0.02
    # SigLIP's vision tower (HF SiglipVisionModel) differs from ViT in these four; the defaults are ViT's.
    class_token: bool = True  # False (SigLIP): the blocks see the patches alone, positions one row per patch
    # The MLP's activation: "gelu" (exact, ViT), "gelu_pytorch_tanh" (SigLIP), "quick_gelu" (OpenAI CLIP:
    # x * sigmoid(1.702 x), HF's QuickGELUActivation)
    act: str = "gelu"
    map_head: bool = False  # SigLIP's attention-pooling head (HF vision_use_head): a learned probe over the tokens
    # What the classifier reads: "cls" the class token (ViT), "mean" the average of the final tokens (what HF's
    # SiglipForImageClassification does: its MAP head is built but unused), "map" the MAP head's pooler_output,
    # "mean_patches" the average of the tokens after the class token (HF's CLIPForImageClassification).
    pool: str = "cls"
    # CLIP's vision tower (HF CLIPVisionModel) differs from ViT in these three; the defaults are ViT's, so a ViT or
    # SigLIP model builds the same modules (and checkpoints keep their FQNs).
    patch_bias: bool = True  # False (CLIP): the patch conv has no bias
    pre_norm: bool = False  # True (CLIP's pre_layrnorm): a LayerNorm on the embeddings, before the first block
    # Where the final LayerNorm applies: "tokens" every final token (ViT, SigLIP: HF's last_hidden_state is normed);
    # "cls" only the pooled class token (CLIP's post_layernorm: last_hidden_state is the last block's output,
    # pooler_output = norm(its class token); CLIPForImageClassification's classifier reads unnormed tokens).
    final_norm: str = "tokens"
    # How pixel bytes become the tower's input (PIXEL_STATS): a pretrained tower wants its processor's statistics
    # (CLIP's flavors and CLIP imports set "clip"); the HF export's preprocessor_config.json writes the same numbers.
    pixel_stats: str = "half"
    # Run fields the trainer sets for every family. A ViT reads neither: images come as pixel bytes (0..255), so the
    # "vocabulary" is 256 values, and a loader row of max_seq_len (= training.seq_len) values holds one image.
    vocab_size: int = 256
    max_seq_len: int = 3 * 224 * 224

    def __post_init__(self) -> None:
        if self.pixel_stats not in PIXEL_STATS or (self.pixel_stats != "half" and self.channels != 3):
            raise ValueError(f"model.args.pixel_stats={self.pixel_stats!r} for {self.channels} channels: use one of "
                             f"{list(PIXEL_STATS)} ('half' for other than 3 channels)")
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.act not in ("gelu", "gelu_pytorch_tanh", "quick_gelu"):
            raise ValueError(f"model.args.act={self.act!r}: use 'gelu' (ViT), 'gelu_pytorch_tanh' (SigLIP) or "
                             f"'quick_gelu' (CLIP)")
        if self.final_norm not in ("tokens", "cls"):
            raise ValueError(f"model.args.final_norm={self.final_norm!r}: use 'tokens' (ViT, SigLIP) or 'cls' (CLIP)")
        needs = {"cls": ("class_token", self.class_token), "map": ("map_head", self.map_head), "mean": ("", True),
                 "mean_patches": ("class_token", self.class_token)}
        if self.pool not in needs:
            raise ValueError(f"model.args.pool={self.pool!r}: use one of {list(needs)}")
        name, ok = needs[self.pool]
        if not ok:
            raise ValueError(f"model.args.pool={self.pool!r} reads model.args.{name}, which is false: set "
                             f"model.args.{name}=true or another pool")
        if self.final_norm == "cls" and (not self.class_token or self.map_head):
            raise ValueError("model.args.final_norm='cls' norms the class token alone (CLIP): it needs "
                             "model.args.class_token=true and map_head=false")
        if self.final_norm == "cls" and self.n_classes and self.pool != "mean_patches":
            # the one classifier HF holds for CLIP; a classifier on the normed class token would need the norm
            # outside the sequence-parallel token layout (parallelize/vit.py), which is not written
            raise ValueError(f"model.args.pool={self.pool!r} with final_norm='cls': a CLIP classifier reads the "
                             f"patch average (HF's CLIPForImageClassification); set model.args.pool='mean_patches'")

    @property
    def mean_std(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """The per-channel mean and std (of pixels scaled to 0..1) the tower's input is normalised with."""
        mean, std = PIXEL_STATS[self.pixel_stats]
        if self.channels != 3:  # "half" only (checked above): its one value per channel
            return (mean[0],) * self.channels, (std[0],) * self.channels
        return mean, std

    def normalise(self, pixel_bytes: torch.Tensor) -> torch.Tensor:
        """Pixel values 0..255 [..., C, H, W] -> the tower's fp32 input ((x / 255 - mean) / std per channel)."""
        if self.pixel_stats == "half":
            return pixel_bytes.to(torch.float32) / 127.5 - 1.0  # (x / 255 - 0.5) / 0.5, as before pixel_stats
        x = pixel_bytes.to(torch.float32, copy=True)
        for c, (mean, std) in enumerate(zip(*self.mean_std)):  # per channel, in place: no statistics tensor to
            x[..., c, :, :].div_(255.0).sub_(mean).div_(std)  # copy to the device at every batch
        return x

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        return self.ffn_dim

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def n_tokens(self) -> int:
        """Tokens the blocks see per image: the patches and the class token (ViT), the patches alone (SigLIP)."""
        return self.n_patches + int(self.class_token)

    @property
    def approximate(self) -> str:
        """GeluFeedForward's `approximate` for `act` (HF's gelu_pytorch_tanh is F.gelu(approximate="tanh"); "quick"
        is CLIP's sigmoid approximation)."""
        return {"gelu_pytorch_tanh": "tanh", "quick_gelu": "quick"}.get(self.act, "none")

    @property
    def pixels(self) -> int:
        """Values per image (C * H * W): what one loader row carries."""
        return self.channels * self.image_size ** 2
