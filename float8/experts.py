"""Routed experts in float8 (float8.moe_experts): the three grouped GEMMs of every MoE's GroupedExperts through
torchao's float8 rowwise grouped GEMM (torchao.prototype.moe_training's _to_fp8_rowwise_then_scaled_grouped_mm):
tokens and each expert's weight cast to float8 e4m3 with dynamic per-row power-of-2 scales, in the forward and in both
backward GEMMs (input and weight gradient), the result in bf16. Weights stay bf16 parameters under the same FQNs:
checkpoints are those of the bf16 model.

The float8 grouped GEMM needs every expert's row count a multiple of 16: GroupedExperts pads its token groups with
zero rows around the three GEMMs (models/common/moe_align.py; static shapes, no host sync), under expert parallel too
(the local experts pad what the all-to-all brought). The router and the shared experts are untouched here: the router
stays high precision, the shared experts are Linears for the dense path (float8.enable's filter).

float8/ is a leaf (it may not import models/): the experts modules are found by their converter hooks, the attributes
`grouped_mm` and `group_align` (docs/contracts.md), which this module sets.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

ALIGN = 16  # rows per token group, and the multiple every expert width must be (the float8 GEMM's 16-byte tiles)
KEY = "float8.moe_experts"


def device_problem() -> str | None:
    """Why this process cannot run float8 grouped GEMMs (torch._scaled_grouped_mm: CUDA capability >= 9.0), or None.
    Reads the capability of the device this rank will use (LOCAL_RANK under torchrun) without making it current."""
    if not torch.cuda.is_available():
        return f"{KEY}=true needs a CUDA GPU of capability >= 9.0 (float8 grouped GEMM); there is none: set {KEY}=false"
    import os

    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    major, minor = torch.cuda.get_device_capability(index)
    if major < 9:
        return (f"{KEY}=true needs CUDA capability >= 9.0 (float8 grouped GEMM: Hopper or newer); this GPU is "
                f"{major}.{minor}: set {KEY}=false")
    return None


def is_experts(module: nn.Module) -> bool:
    """A routed-experts module that takes a converter's grouped GEMM (models/common/moe.py GroupedExperts)."""
    return hasattr(module, "group_align") and hasattr(module, "grouped_mm") and hasattr(module, "w1")


def experts_problems(model: nn.Module) -> list[str]:
    """What keeps `model` (meta or not) from float8 routed experts: none at all, or widths not multiples of 16."""
    found = [(name, m) for name, m in model.named_modules() if is_experts(m)]
    if not found:
        return [f"{KEY}=true but the model has no routed experts (no MoE layer): set {KEY}=false"]
    name, m = found[0]
    hidden, dim = m.w1.shape[1], m.w1.shape[2]
    if hidden % ALIGN or dim % ALIGN:
        return [f"{KEY}=true needs expert widths that are multiples of {ALIGN}; {name} has dim {dim}, hidden "
                f"{hidden}: set {KEY}=false"]
    return []


@functools.cache
def grouped_mm():
    """The float8 grouped GEMM as GroupedExperts calls it, mm(x [M, in], w_t [E, in, out], offs) -> [M, out] bf16.
    One function object for every layer: a compiled MoE guards on it, so one per layer would recompile each."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    def float8_grouped_mm(x: torch.Tensor, w_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        # Groups arrive padded (GroupedExperts.group_align): torchao's own padding would read offsets on the host.
        return _to_fp8_rowwise_then_scaled_grouped_mm(x, w_t, offs, torch.bfloat16, torch.float8_e4m3fn, False)

    return float8_grouped_mm


def convert_experts(model: nn.Module, mm=None) -> list[str]:
    """Set the float8 grouped GEMM (`mm`: grouped_mm() unless given, e.g. by tests) on every routed-experts module of
    `model`, in place; returns their FQNs. Raises with one line where experts_problems or device_problem object."""
    problems = experts_problems(model) + ([device_problem()] if mm is None else [])
    problems = [p for p in problems if p]
    if problems:
        raise ValueError(problems[0])
    mm = grouped_mm() if mm is None else mm
    names = []
    for name, m in model.named_modules():
        if is_experts(m):
            m.grouped_mm, m.group_align = mm, ALIGN
            names.append(name)
    return names
