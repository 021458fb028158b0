"""FSDP2 (`fully_shard`) for decoder models: `layers` (a ModuleDict of blocks) between the top-level modules that run
before them (the embeddings) and after them (final norm, output projection), whose names the model's plan passes.

Parameter groups (one all-gather / reduce-scatter each):
  each input module | layers[i] for each block | [output modules] | the root (whatever is left)
A 2-D mesh (dp_replicate, dp_shard) gives HSDP: shard within a row, all-reduce gradients across rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

if TYPE_CHECKING:
    from titanlike.config.sections import Parallelism, Training

RESHARD_MODES = ("default", "always", "never")  # parallelism.fsdp_reshard_after_forward (config validation reads it)


def resolve_reshard_after_forward(mode: str, pp_enabled: bool = False) -> bool:
    """"always": free unsharded params after forward (re-gather in backward; least memory).
    "never": keep them until backward (ZeRO-2-like; one all-gather fewer per step).
    "default": always, except under pipeline parallelism, where each micro-batch's backward follows
    soon after and re-gathering per micro-batch would multiply the all-gathers.
    """
    if mode not in RESHARD_MODES:
        raise ValueError(f"fsdp_reshard_after_forward must be one of {RESHARD_MODES}, got {mode!r}")
    if mode == "default":
        return not pp_enabled
    return mode == "always"


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: str = "default",
    cpu_offload: bool = False,
    pp_enabled: bool = False,
    input_modules: tuple[str, ...] = (),
    output_modules: tuple[str, ...] = (),
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard `model` in place over `dp_mesh` (1-D: FSDP, 2-D (replicate, shard): HSDP); returns it.

    param_dtype / reduce_dtype: compute and gradient-reduction dtypes (bf16 / fp32 on CUDA; fp32 / fp32
    on CPU, where bf16 matmuls are slow and the parity tests need fp32).
    """
    if dp_mesh.ndim not in (1, 2):
        raise ValueError(f"apply_fsdp: dp_mesh must be 1-D (FSDP) or 2-D (HSDP), got {dp_mesh.ndim}-D {dp_mesh}")
    reshard = resolve_reshard_after_forward(reshard_after_forward, pp_enabled)
    config = {"mesh": dp_mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)}
    if cpu_offload:
        config["offload_policy"] = CPUOffloadPolicy()
    if ignored_params:  # expert-parallel experts without replicas: nothing to shard or reduce (parallelize/ep.py)
        config["ignored_params"] = ignored_params

    # Embeddings in their own group: with a large vocabulary they are big, and in the root group they
    # would stay unsharded for the whole step.
    for name in input_modules:  # a dotted name is a submodule's own group ("vision.layers.0" before "vision")
        module = _submodule(model, name)
        if module is not None:  # None: a pipeline stage without it
            fully_shard(module, **config, reshard_after_forward=reshard)

    blocks = [b for b in model.layers.values() if b is not None]
    for i, block in enumerate(blocks):
        # The last block's backward runs right after the loss/output backward: resharding it after forward
        # would only free memory to all-gather the same parameters again moments later.
        last = i == len(blocks) - 1
        keep_last = last and reshard_after_forward == "default"
        fully_shard(block, **config, reshard_after_forward=reshard and not keep_last)

    # Final norm + output projection: one group, never resharded after forward (their backward comes first).
    tail = [getattr(model, name) for name in output_modules if getattr(model, name, None) is not None]
    if tail:
        fully_shard(tail, **config, reshard_after_forward=False)

    # Root: anything not covered above. FSDP2 never reshards the root after forward.
    fully_shard(model, **config, reshard_after_forward=reshard)
    return model


def _submodule(model: nn.Module, path: str) -> nn.Module | None:
    for name in path.split("."):
        model = getattr(model, name, None)
        if model is None:
            return None
    return model


def fsdp_dtypes(dims, training: Training) -> tuple[torch.dtype, torch.dtype]:
    """bf16/fp32 (from config) on CUDA; fp32/fp32 on CPU, where parity tests need exact float32."""
    if dims.world_mesh is None or dims.world_mesh.device_type == "cpu":
        return torch.float32, torch.float32

    def dtype(name: str) -> torch.dtype:
        value = getattr(torch, name, None)
        if not isinstance(value, torch.dtype):
            raise ValueError(f"training.mixed_precision_*: {name!r} is not a torch dtype")
        return value

    return dtype(training.mixed_precision_param), dtype(training.mixed_precision_reduce)


def maybe_fsdp(model: nn.Module, dims, par: Parallelism, training: Training, input_modules: tuple[str, ...] = (),
               output_modules: tuple[str, ...] = ()) -> None:
    """FSDP2/HSDP over the ParallelDims' FSDP mesh with training's mixed-precision dtypes and parallelism's reshard
    mode; nothing without FSDP.
    input_modules / output_modules: the model's top-level modules before / after `layers` (see apply_fsdp)."""
    if not dims.fsdp_enabled:
        return
    mesh = dims.fsdp_mesh
    if mesh is None:
        raise RuntimeError("parallelize: FSDP is enabled but ParallelDims.build_mesh() was not called")
    param_dtype, reduce_dtype = fsdp_dtypes(dims, training)
    ignored = None
    if dims.ep > 1:  # the routed experts first: FSDP over the ranks holding the same experts
        from parallelize.ep import fsdp_experts

        reshard = resolve_reshard_after_forward(par.fsdp_reshard_after_forward, dims.pp_enabled)
        ignored = fsdp_experts(model, dims, {"reshard_after_forward": reshard, "mp_policy": MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=reduce_dtype)})
    apply_fsdp(
        model, mesh, param_dtype, reduce_dtype,
        reshard_after_forward=par.fsdp_reshard_after_forward, pp_enabled=dims.pp_enabled,
        input_modules=input_modules, output_modules=output_modules, ignored_params=ignored,
    )
