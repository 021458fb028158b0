"""The Llama 3 parallelization plans. Order matters and is kept visible: (TP) -> AC -> compile -> FSDP.

AC before compile so the checkpoint is traced into each block's graph; compile before FSDP so FSDP2's
hooks run outside the compiled blocks; FSDP last because it wraps whatever the block has become.
"""

from __future__ import annotations

import torch
from torch import nn

from parallelize.ac import apply_ac
from parallelize.compile import apply_compile
from parallelize.fsdp import apply_fsdp
from titanlike.parallel_dims import ParallelDims


def _refuse_unimplemented(dims: ParallelDims) -> None:
    # Config validation refuses these too; checking here keeps a hand-built ParallelDims honest.
    for name, degree in (("tp", dims.tp), ("pp", dims.pp), ("cp", dims.cp), ("ep", dims.ep)):
        if degree > 1:
            raise ValueError(
                f"parallelism.{name}={degree}: the llama3 plans do not implement {name.upper()} yet "
                f"(tensor/pipeline/context/expert parallelism land in later issues); set parallelism.{name}=1"
            )


def _fsdp_dtypes(dims: ParallelDims, training_cfg) -> tuple[torch.dtype, torch.dtype]:
    """bf16/fp32 (from config) on CUDA; fp32/fp32 on CPU, where parity tests need exact float32."""
    if dims.world_mesh is None or dims.world_mesh.device_type == "cpu":
        return torch.float32, torch.float32

    def dtype(name: str) -> torch.dtype:
        value = getattr(torch, name, None)
        if not isinstance(value, torch.dtype):
            raise ValueError(f"training.mixed_precision_*: {name!r} is not a torch dtype")
        return value

    return dtype(training_cfg.mixed_precision_param), dtype(training_cfg.mixed_precision_reduce)


def _maybe_fsdp(model: nn.Module, dims: ParallelDims, cfg) -> None:
    if not dims.fsdp_enabled:
        return
    mesh = dims.fsdp_mesh
    if mesh is None:
        raise RuntimeError("parallelize: FSDP is enabled but ParallelDims.build_mesh() was not called")
    param_dtype, reduce_dtype = _fsdp_dtypes(dims, cfg.training)
    apply_fsdp(
        model, mesh, param_dtype, reduce_dtype,
        reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward, pp_enabled=dims.pp_enabled,
    )


def parallelize_llama(model: nn.Module, dims: ParallelDims, cfg) -> nn.Module:
    """Default plan: AC -> per-block compile -> FSDP2/HSDP. `cfg` is the JobConfig; returns the model."""
    _refuse_unimplemented(dims)
    # TP would go first here (it changes parameter placements that AC/compile/FSDP then see).
    apply_ac(model, cfg.activation_checkpoint)
    apply_compile(model, cfg.compile)
    _maybe_fsdp(model, dims, cfg)
    return model


def parallelize_llama_fsdp_only(model: nn.Module, dims: ParallelDims, cfg) -> nn.Module:
    """Alternative plan: FSDP2/HSDP only; ignores the AC and compile sections (a baseline for debugging)."""
    _refuse_unimplemented(dims)
    _maybe_fsdp(model, dims, cfg)
    return model
