"""Model registry: name -> ModelSpec (models/spec.py). An explicit dict, so what exists is visible here; a family
adds one line. Importing this package changes no global state."""
from __future__ import annotations

from models import bert, deepseek_v3, gpt, llama3, t5
from models import llava, mamba2, mixtral, nemotron_h, qwen3, qwen3_next, vit
from models.spec import ModelSpec

# The family that the default config and the tools' defaults use (configs/debug_model.toml names it too).
DEFAULT_MODEL = "llama3"

MODELS: dict[str, ModelSpec] = {
    llama3.SPEC.name: llama3.SPEC,
    deepseek_v3.SPEC.name: deepseek_v3.SPEC,
    qwen3.SPEC.name: qwen3.SPEC,
    mixtral.SPEC.name: mixtral.SPEC,
    gpt.SPEC.name: gpt.SPEC,
    nemotron_h.SPEC.name: nemotron_h.SPEC,
    mamba2.SPEC.name: mamba2.SPEC,
    qwen3_next.SPEC.name: qwen3_next.SPEC,
    bert.SPEC.name: bert.SPEC,
    t5.SPEC.name: t5.SPEC,
    vit.SPEC.name: vit.SPEC,
    llava.SPEC.name: llava.SPEC,
}


def get_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model.name={name!r}; known models: {sorted(MODELS)}") from None


def spec_of(model) -> ModelSpec:
    """The registered spec whose model_cls built `model`: its own class, else the nearest base class (FSDP and other
    wrappers subclass the model's class). For callers that hold a bare model (titanlike/infer/generate.py)."""
    for cls in type(model).__mro__:
        for spec in MODELS.values():
            if spec.model_cls is cls:
                return spec
    raise ValueError(f"no registered ModelSpec builds {type(model).__name__}: register its family in "
                     f"models.MODELS or pass its spec")


__all__ = ["DEFAULT_MODEL", "MODELS", "ModelSpec", "get_spec", "spec_of"]
