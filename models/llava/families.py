"""The families LLaVA composes, by name: a vision tower family and the decoder families whose model it can use as
the language model (their own specs, so their args, adapters and checks apply unchanged). A decoder family joins by
one entry here once its forward is models/common/decoder.py's (Llava reuses its attention inputs)."""
from __future__ import annotations

from models.llama3 import SPEC as LLAMA3
from models.qwen3 import SPEC as QWEN3
from models.vit import SPEC as VIT

LANGUAGE = {s.name: s for s in (LLAMA3, QWEN3)}
VISION = {s.name: s for s in (VIT,)}


def language(name: str):
    if name not in LANGUAGE:
        raise ValueError(f"model.args.language_family={name!r}: choose one of {sorted(LANGUAGE)}")
    return LANGUAGE[name]


def vision(name: str):
    if name not in VISION:
        raise ValueError(f"model.args.vision_family={name!r}: choose one of {sorted(VISION)}")
    return VISION[name]
