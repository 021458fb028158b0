"""Model registry: name -> ModelSpec. An explicit dict (no decorators or import-time registration), so
what exists is visible here and importing this package changes no global state."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

from models import llama3
from models.llama3 import hf as llama3_hf


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_cls: type
    args_cls: type
    flavors: dict = field(default_factory=dict)  # flavor name -> args instance (treat as read-only;
    # use dataclasses.replace to derive a modified copy, e.g. the tokenizer's vocab_size)
    hf_adapter: ModuleType | None = None  # module with to_hf / from_hf / args_from_hf_config


MODELS: dict[str, ModelSpec] = {
    "llama3": ModelSpec(
        name="llama3",
        model_cls=llama3.Transformer,
        args_cls=llama3.ModelArgs,
        flavors=llama3.llama3_flavors,
        hf_adapter=llama3_hf,
    ),
}


def get_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {sorted(MODELS)}") from None


__all__ = ["MODELS", "ModelSpec", "get_spec"]
