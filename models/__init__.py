"""Model registry: name -> ModelSpec (models/spec.py). An explicit dict, so what exists is visible here; a family
adds one line. Importing this package changes no global state."""
from __future__ import annotations

from models import llama3
from models.spec import ModelSpec

# The family that the default config and the tools' defaults use (configs/debug_model.toml names it too).
DEFAULT_MODEL = "llama3"

MODELS: dict[str, ModelSpec] = {
    llama3.SPEC.name: llama3.SPEC,
}


def get_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model.name={name!r}; known models: {sorted(MODELS)}") from None


__all__ = ["DEFAULT_MODEL", "MODELS", "ModelSpec", "get_spec"]
