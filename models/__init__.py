"""Model registry: name -> ModelSpec (models/spec.py). An explicit dict, so what exists is visible here; a family
adds one line. Importing this package changes no global state."""
from __future__ import annotations

from models import deepseek_v3, gpt, llama3
from models import mixtral, qwen3
from models.spec import ModelSpec

# The family that the default config and the tools' defaults use (configs/debug_model.toml names it too).
DEFAULT_MODEL = "llama3"

MODELS: dict[str, ModelSpec] = {
    llama3.SPEC.name: llama3.SPEC,
    deepseek_v3.SPEC.name: deepseek_v3.SPEC,
    qwen3.SPEC.name: qwen3.SPEC,
    mixtral.SPEC.name: mixtral.SPEC,
    gpt.SPEC.name: gpt.SPEC,
}


def get_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model.name={name!r}; known models: {sorted(MODELS)}") from None


__all__ = ["DEFAULT_MODEL", "MODELS", "ModelSpec", "get_spec"]
