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
    # SigLIP's vision tower (HF SiglipVisionModel) differs from ViT in these four; the defaults are ViT's.
    class_token: bool = True  # False (SigLIP): the blocks see the patches alone, positions one row per patch
    act: str = "gelu"  # the MLP's GELU: "gelu" (exact, ViT) or "gelu_pytorch_tanh" (SigLIP)
    map_head: bool = False  # SigLIP's attention-pooling head (HF vision_use_head): a learned probe over the tokens
    # What the classifier reads: "cls" the class token (ViT), "mean" the average of the final tokens (what HF's
    # SiglipForImageClassification does: its MAP head is built but unused), "map" the MAP head's pooler_output.
    pool: str = "cls"
    # Run fields the trainer sets for every family. A ViT reads neither: images come as pixel bytes (0..255), so the
    # "vocabulary" is 256 values, and a loader row of max_seq_len (= training.seq_len) values holds one image.
    vocab_size: int = 256
    max_seq_len: int = 3 * 224 * 224

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.act not in ("gelu", "gelu_pytorch_tanh"):
            raise ValueError(f"model.args.act={self.act!r}: use 'gelu' (ViT) or 'gelu_pytorch_tanh' (SigLIP)")
        needs = {"cls": ("class_token", self.class_token), "map": ("map_head", self.map_head), "mean": ("", True)}
        if self.pool not in needs:
            raise ValueError(f"model.args.pool={self.pool!r}: use one of {list(needs)}")
        name, ok = needs[self.pool]
        if not ok:
            raise ValueError(f"model.args.pool={self.pool!r} reads model.args.{name}, which is false: set "
                             f"model.args.{name}=true or another pool")

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
        """F.gelu's `approximate` for `act` (HF's gelu_pytorch_tanh is F.gelu(approximate="tanh"))."""
        return "tanh" if self.act == "gelu_pytorch_tanh" else "none"

    @property
    def pixels(self) -> int:
        """Values per image (C * H * W): what one loader row carries."""
        return self.channels * self.image_size ** 2
