"""Process-group setup and teardown from torchrun's environment.

A single process (WORLD_SIZE unset or 1) gets no process group at all: every caller must treat
"no group" as "world of one", which keeps unit tests and `python scripts/train.py` free of torchrun.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value) if value != "" else default
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def pick_device(name: str, local_rank: int) -> torch.device:
    """training.device ("auto" | "cuda" | "cpu") -> this rank's device."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("training.device='cuda' but no CUDA device is visible; use training.device='cpu'")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(
    device_type: str, timeout_s: float = 600.0, cpu_collectives_on_cuda: bool = False
) -> tuple[int, int, int]:
    """Join the job started by torchrun; returns (rank, world_size, local_rank).

    device_type: "cuda" -> NCCL, with the current device set to LOCAL_RANK; "cpu" -> gloo.
    timeout_s: collective timeout; a hung collective raises after this long instead of waiting forever.
    cpu_collectives_on_cuda: also attach gloo for CPU tensors ("cuda:nccl,cpu:gloo"), which async
        checkpointing needs; off by default because every new group then costs a gloo group too.
    """
    world_size = _env_int("WORLD_SIZE", 1)
    if world_size <= 1:
        return 0, 1, 0
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"init_distributed: device_type must be 'cuda' or 'cpu', got {device_type!r}")
    if dist.is_initialized():  # e.g. a test that set the group up itself; never initialise twice
        return dist.get_rank(), dist.get_world_size(), local_rank
    kwargs = {}
    if device_type == "cuda":
        # Set the device before NCCL starts, so each rank's communicator lands on its own GPU.
        torch.cuda.set_device(local_rank)
        backend = "cuda:nccl,cpu:gloo" if cpu_collectives_on_cuda else "nccl"
        kwargs["device_id"] = torch.device("cuda", local_rank)
    else:
        backend = "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    return rank, world_size, local_rank


def destroy_distributed(barrier: bool = True) -> None:
    """Tear the process group down (no-op when there is none).

    The barrier first: without it a rank that finishes early destroys gloo's transport while a peer
    still talks to it, and the job occasionally aborts at exit ("terminate called without an active
    exception", see STACK_NOTES). barrier=False after a failed collective: the peers are gone or stuck,
    and a barrier would only wait out the timeout again.
    """
    if not dist.is_initialized():
        return
    try:
        if barrier:
            dist.barrier()
    finally:
        dist.destroy_process_group()
