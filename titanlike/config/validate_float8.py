"""float8.moe_experts's rules (float8/experts.py), each one line naming the key: at load time, before any process
group exists, the device (float8 grouped GEMMs need CUDA capability >= 9.0) and the flavor's model on meta (it must
have routed experts, their widths multiples of 16). float8.convert checks both again on the run's model."""
from __future__ import annotations

from titanlike.config.sections import JobConfig


def check_float8_experts(cfg: JobConfig, errors: list[str]) -> None:
    if not (cfg.float8.enable and cfg.float8.moe_experts):
        return  # (moe_experts without enable: float8.config_problems says so)
    if cfg.training.device == "cpu":
        errors.append("float8.moe_experts=true needs a CUDA GPU of capability >= 9.0 (float8 grouped GEMM); "
                      "training.device is \"cpu\": set float8.moe_experts=false")
        return
    from float8.experts import device_problem

    problem = device_problem()
    if problem:
        errors.append(problem)


def check_float8_experts_model(cfg: JobConfig, spec, args, errors: list[str]) -> None:
    """The flavor's model, built on meta, against float8.moe_experts (experts present, widths multiples of 16)."""
    if not (cfg.float8.enable and cfg.float8.moe_experts) or errors:
        return
    import torch

    from float8.experts import experts_problems

    with torch.device("meta"):
        model = spec.model_cls(args)
    errors.extend(experts_problems(model))
