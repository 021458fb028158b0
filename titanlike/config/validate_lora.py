"""The [lora] section's rules (docs/post_training.md#lora): its values at load time, and what needs the model (targets
that match nothing, a rank above a layer's width), checked on a meta model at load time (validate) and again on the
run's model in build_model, each as one line naming the key and the fix."""
from __future__ import annotations

from titanlike.config.sections import JobConfig, Lora


def check_lora(cfg: JobConfig, errors: list[str]) -> None:
    lora = cfg.lora
    if not lora.enable:
        return
    if lora.rank < 1:
        errors.append(f"lora.rank={lora.rank} must be >= 1 (typical: 8 to 64)")
    if not lora.alpha > 0:
        errors.append(f"lora.alpha={lora.alpha} must be > 0 (the adapters are scaled by alpha / rank; PEFT's "
                      f"default is 2 * rank)")
    if not 0.0 <= lora.dropout < 1.0:
        errors.append(f"lora.dropout={lora.dropout} must be in [0, 1)")
    if not lora.target_modules or not all(isinstance(t, str) and t for t in lora.target_modules):
        errors.append(f"lora.target_modules={lora.target_modules!r} must list module names, e.g. [\"wq\", \"wv\"]")
    if cfg.float8.enable:
        errors.append("lora.enable with float8.enable: both swap the same Linear layers; set float8.enable=false "
                      "for a LoRA run")


def lora_model_problems(model, lora: Lora, head: str | None) -> list[str]:
    """Target and rank problems of `model` (meta or not); `head`: the output projection's name when the chunked loss
    replaces it (training.loss_chunk_tokens > 0), else None."""
    from models.common.lora import lora_problems

    return lora_problems(model, list(lora.target_modules), lora.rank, lora.include_experts, head)


def check_lora_model(cfg: JobConfig, spec, args, errors: list[str]) -> None:
    """At load time, before any process group: the flavor's model on meta against the [lora] settings (the run's
    vocabulary may differ; build_model checks the run's model again)."""
    if not cfg.lora.enable or errors:
        return
    import torch

    with torch.device("meta"):
        model = spec.model_cls(args)
    head = spec.output_modules[-1] if cfg.training.loss_chunk_tokens > 0 else None
    errors.extend(lora_model_problems(model, cfg.lora, head))


def lora_advice(cfg: JobConfig) -> list[str]:
    """Warnings (validate.advise): a LoRA run on the seeded random base, which is rarely what was meant."""
    if cfg.lora.enable and not cfg.checkpoint.initial_load_path:
        return ["lora.enable without checkpoint.initial_load_path: the frozen base is the seeded random init "
                "(training.seed), not a pretrained model; set checkpoint.initial_load_path to the base's checkpoint "
                "(scripts/convert_hf.py import makes one from an HF model)"]
    return []
