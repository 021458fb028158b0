"""Shared by the LoRA tests: a model built on meta, adapted, materialised and seeded the way the trainer does it,
and adapters whose B is random (a fresh B = 0 adapter would hide every mistake in the adapter branch)."""
from __future__ import annotations

import torch

from models.common.lora import apply_lora, init_adapters


def lora_model(spec, args, targets, *, lora: bool = True, seed: int = 0, **lora_kw) -> torch.nn.Module:
    with torch.device("meta"):
        model = spec.model_cls(args)
    if lora:
        apply_lora(model, targets, **lora_kw)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    init_adapters(model)
    return model


def randomise_b(model: torch.nn.Module, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
