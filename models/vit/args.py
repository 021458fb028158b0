"""ViT model arguments (named sizes in flavors.py; run knobs live in configs/)."""
from __future__ import annotations

from dataclasses import dataclass


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
    # Run fields the trainer sets for every family. A ViT reads neither: images come as pixel bytes (0..255), so the
    # "vocabulary" is 256 values, and a loader row of max_seq_len (= training.seq_len) values holds one image.
    vocab_size: int = 256
    max_seq_len: int = 3 * 224 * 224

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")

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
        """Tokens the blocks see per image: the patches and the class token."""
        return self.n_patches + 1

    @property
    def pixels(self) -> int:
        """Values per image (C * H * W): what one loader row carries."""
        return self.channels * self.image_size ** 2
