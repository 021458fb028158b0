"""The constants that turn a traced peak of live tensor bytes into a device-memory requirement. ONE place, so a
GPU measurement can calibrate them.

The fragmentation factors are measured (below); the CUDA context and NCCL figures are still first guesses. To
calibrate further, run a layout on the GPU, read `torch.cuda.max_memory_reserved()` after a few steps (and
nvidia-smi's used memory for the context), and compare with `scripts/plan.py estimate` for the same config.

What the trace cannot see:
  - the CUDA context and the kernels' code (nvidia-smi counts them, torch.cuda.memory_allocated does not): ~0.5-0.8 GiB
    on an H100 with cuBLAS/cuDNN workspaces loaded;
  - NCCL's communicator buffers: a few hundred MiB per communicator on NVLink, more with many channels;
  - the caching allocator's fragmentation (reserved - allocated at the peak): typically 5-15% of the peak in
    steady-state training without expandable segments.
"""
from __future__ import annotations

GiB = 1024 ** 3

# Calibrated 2026-11-24 on one H100 (torch 2.11) with each compiled block's saved bytes emulated
# (titanlike/planner/compiled.py): six one-GPU runs (1B shape without, with full and with selective AC; 32k context; a
# 774M GPT; an 8B-shape 4-layer cut), traced peak x (1 + FRAGMENTATION) against torch.cuda.max_memory_reserved()
# (-6% to +4% with it); FRAGMENTATION_FSDP fitted to five 2x H200 FSDP runs; docs/benchmarks.md "Memory" has the
# tables. CUDA_CONTEXT_BYTES and the NCCL allowance are still estimates (they sit outside torch's reserved memory).
CALIBRATED = True

CUDA_CONTEXT_BYTES = int(0.75 * GiB)  # per process: CUDA context, cuBLAS/cuDNN workspaces, loaded kernels
NCCL_BYTES_PER_GROUP = int(0.25 * GiB)  # per process group this rank communicates in (world > 1 only)
NCCL_MAX_GROUPS = 4  # groups counted at most (flattened meshes share communicators lazily)
FRAGMENTATION = 0.06  # fraction of the traced peak the caching allocator holds but cannot use
# Under FSDP the all-gather and reduce-scatter buffers are allocated on other streams, and the caching allocator
# does not reuse one stream's freed blocks for another's: it holds far more. Fitted to the five 2x H200 FSDP runs of
# docs/benchmarks.md (8B with SAC-2, per-op SAC, no AC, no AC without resharding; 8B_4L SAC-2: -4% to +4% with it).
FRAGMENTATION_FSDP = 0.28


def fragmentation(fsdp: bool) -> float:
    return FRAGMENTATION_FSDP if fsdp else FRAGMENTATION

# MoE routing (titanlike/planner/moe.py): the trace routes every token perfectly balanced. Under expert parallelism an
# EP rank receives MOE_IMBALANCE x the balanced share of tokens (all-to-all receive buffers, the local experts'
# activations, the combine's buffers scale with it). 1.0 = balanced; measured routing with an auxiliary/bias balancer
# typically has its hottest rank 1.1-1.5x the mean early in training. Uncalibrated.
MOE_IMBALANCE = 1.0


def allowance_parts(peak_bytes: int, n_groups: int, device_kind: str = "cuda", fsdp: bool = False
                    ) -> tuple[int, int]:
    """(the caching allocator's fragmentation, CUDA context + NCCL buffers): bytes to add to a traced peak of live
    tensor bytes on one rank; (0, 0) on CPU, where there is neither."""
    if device_kind != "cuda":
        return 0, 0
    nccl = NCCL_BYTES_PER_GROUP * min(n_groups, NCCL_MAX_GROUPS)
    return int(fragmentation(fsdp) * peak_bytes), CUDA_CONTEXT_BYTES + nccl


def allowance(peak_bytes: int, n_groups: int, device_kind: str = "cuda", fsdp: bool = False) -> int:
    """Bytes to add to a traced peak of live tensor bytes on one rank (0 on CPU, where there is no context)."""
    return sum(allowance_parts(peak_bytes, n_groups, device_kind, fsdp))
