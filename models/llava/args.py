"""LLaVA model arguments: a vision tower's args (a vision family's, models/vit), a decoder family's args (the language
model, looked up by name: llama3, qwen3, ...) and what joins them (the projector, where the image features come
from, the placeholder token)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

FREEZE_KEYS = ("vision", "projector", "language")  # model.args.freeze entries (training stages)


def family_args(family: str, value: Any) -> Any:
    """A family's args from a dict (a checkpoint's JSON) or as they are."""
    if not isinstance(value, dict):
        return value
    from models.llava import families  # late: args first, then the families' specs

    spec = families.vision(family) if family in families.VISION else families.language(family)
    return spec.args_cls(**value)


@dataclass
class ModelArgs:
    # The tower's family. A SigLIP tower is the vit family with its SigLIP options (class_token=False, tanh GELU: the
    # "debug-siglip" / "siglip-*" flavors of models/vit), so it needs no family of its own; HF: SiglipVisionModel.
    vision_family: str = "vit"
    vision: Any = None  # that family's args (n_classes ignored: the tower has no head)
    language_family: str = "llama3"  # any decoder family on models/common/decoder.py
    # That family's args, its architecture only: vocab_size / max_seq_len / n_layers below are authoritative (the
    # trainer sets them on this object), kept out of here so find_flavor and checkpoints see one copy.
    text: Any = None
    vocab_size: int = 2048
    max_seq_len: int = 2048
    n_layers: int = 4  # the language model's blocks
    # HF LlavaConfig: hidden_states[vision_feature_layer] of the tower (index 0: the embeddings, i: after block i;
    # negative from the end) and "default" drops the first token (a ViT/CLIP class token; HF drops it from a SigLIP
    # tower too, a patch: llava-hf's SigLIP models use "full"), "full" keeps every token.
    vision_feature_layer: int = -2
    vision_feature_select_strategy: str = "default"
    projector_act: str = "gelu"  # HF projector_hidden_act
    projector_bias: bool = True  # HF multimodal_projector_bias
    image_token_id: int = -1  # the placeholder; negative: counted from the vocabulary's end (a spare row)
    # The data layout: a loader row holds this many image slots of pixel bytes, then the tokens (objective.py).
    images_per_row: int = 1
    # Training stages: parts whose parameters get no gradient (and no optimizer state): "vision", "projector",
    # "language". LLaVA's stage 1 (alignment) freezes ["vision", "language"]; stage 2 ["vision"].
    freeze: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.vision = family_args(self.vision_family, self.vision)
        self.text = family_args(self.language_family, self.text)
        if self.text is not None:  # run fields live at the top (see `text`)
            self.text = dataclasses.replace(self.text, vocab_size=1, max_seq_len=1, n_layers=1)
        bad = [k for k in self.freeze if k not in FREEZE_KEYS]
        if bad:
            raise ValueError(f"freeze={self.freeze}: unknown part(s) {bad}; choose from {list(FREEZE_KEYS)}")
        if self.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy={self.vision_feature_select_strategy!r}: 'default' "
                             f"(drop the class token) or 'full'")
        if self.vision is not None and not -self.vision.n_layers - 1 <= self.vision_feature_layer <= \
                self.vision.n_layers:
            raise ValueError(f"vision_feature_layer={self.vision_feature_layer} outside the tower's "
                             f"{self.vision.n_layers} layers (+ the embeddings)")

    @property
    def text_args(self) -> Any:
        """The language model's full args."""
        return dataclasses.replace(self.text, vocab_size=self.vocab_size, max_seq_len=self.max_seq_len,
                                   n_layers=self.n_layers)

    @property
    def dim(self) -> int:
        return self.text.dim

    @property
    def vision_layers_used(self) -> int:
        """Tower blocks that reach the features (the rest, and the tower's final norm, are not built)."""
        k = self.vision_feature_layer
        return k if k >= 0 else self.vision.n_layers + 1 + k

    @property
    def image_tokens(self) -> int:
        """Placeholders per image: the tower's tokens (patches, + a class token if it has one), less the first with
        strategy 'default'."""
        return self.vision.n_tokens - (self.vision_feature_select_strategy == "default")

    @property
    def image_token(self) -> int:
        return self.image_token_id % self.vocab_size

    @property
    def pixels(self) -> int:
        return self.vision.pixels
