"""Before step 1: can this run write its checkpoints at all? (CheckpointManager.preflight, called by the Trainer.)

A read-only or unwritable checkpoint folder, or a disk without room for one checkpoint, used to surface only at
the first save, after `checkpoint.interval` steps of compute. Here: a probe file is created (O_EXCL, fsync) and
removed in the folder, and the free space is compared with an estimate of one checkpoint's size (the model and
optimizer state, in bytes, as DCP writes them: each replicated tensor once) times what keep_latest_k keeps.
"""
from __future__ import annotations

import logging
import os
import shutil
import socket

import torch

from titanlike.checkpoint.layout import CheckpointError, describe_error, scan

logger = logging.getLogger("titanlike")
OVERHEAD = 1 << 20  # DCP's .metadata, meta.json, config.toml, the manifest and the small pickled states


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return ""


def probe_writable(folder: str, what: str, fix: str) -> None:
    """Create `folder` if needed, then create, fsync and remove a small file in it; CheckpointError naming the
    folder, the reason and `fix` if any of that fails."""
    probe = os.path.join(folder, f".write-probe-{socket.gethostname()}-{os.getpid()}")
    file = next((p for p in _self_and_parents(folder) if os.path.exists(p) and not os.path.isdir(p)), None)
    if file is not None:  # not a permission problem: say what is in the way
        where = "is a file, not a folder" if file == os.path.abspath(folder) else f"lies under {file}, a file"
        raise CheckpointError(f"{what} {folder} {where}: move the file away, or point checkpoint.folder (or "
                              f"job.dump_folder) elsewhere")
    try:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"titanlike write probe\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CheckpointError(f"{what} {folder} is not writable ({describe_error(e)}): {fix}") from None


def _self_and_parents(folder: str) -> list[str]:
    path, out = os.path.abspath(folder), []
    while True:
        out.append(path)
        if os.path.dirname(path) == path:
            return out
        path = os.path.dirname(path)


def _share(t: torch.Tensor) -> float:
    """The bytes of `t` this rank accounts for: its local shard, divided among the ranks holding the same shard
    (DTensor Replicate placements), so summing over ranks counts every tensor once, as DCP writes it."""
    local = t.to_local() if hasattr(t, "to_local") else t
    n = local.numel() * local.element_size()
    mesh, placements = getattr(t, "device_mesh", None), getattr(t, "placements", ())
    for dim, p in enumerate(placements):
        if p.is_replicate():
            n /= mesh.size(dim)
    return n


def state_bytes(model_sd: dict, optimizers: list) -> tuple[float, float]:
    """(model, optimizer) bytes of this rank's share of one checkpoint. The optimizer's state is read from the
    optimizers themselves (DCP's get_optimizer_state_dict would create it by taking a step); before the first
    step there is none yet: AdamW's two moments are assumed, in fp32 (titanlike's master-weight AdamW keeps them
    fp32; torch's keeps the parameters' dtype, fp32 for every sharded layout)."""
    model = sum(_share(v) for v in model_sd.values() if isinstance(v, torch.Tensor))
    optim = sum(_share(v) for opt in optimizers for state in opt.state.values() for v in state.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    if optim == 0:
        for opt in optimizers:
            for group in opt.param_groups:
                if "betas" in group:
                    optim += sum(2 * 4 * _share(p) / p.element_size() for p in group["params"])
    return model, optim


def check_folder(folder: str, model: float, optim: float, keep: int, export_scale: float) -> None:
    """Rank 0: `folder` is writable and its disk has room for the steps this run keeps: keep_latest_k of them plus
    the one being written (fewer where steps already on disk will be rotated out), plus a model-only export
    (`export_scale` x the model bytes: its dtype's share, 0 without one)."""
    probe_writable(folder, "checkpoint folder", "fix its permissions or mount, or point checkpoint.folder (or "
                                                "job.dump_folder) at a writable disk")
    one = model + optim + OVERHEAD
    existing = sum(1 for info in scan(folder).values() if info.complete)
    copies = max(1, keep + 1 - existing) if keep > 0 else 1
    need = copies * one + export_scale * model
    free = shutil.disk_usage(folder).free
    if free < need:
        kept = (f"keep_latest_k={keep} keeps {keep} of them plus the one being written ({existing} already there)"
                if keep > 0 else "at least one of them")
        raise CheckpointError(
            f"checkpoint folder {folder} has {_size(free)} free, but this run needs about {_size(need)}: one "
            f"checkpoint is about {_size(one)} ({_size(model)} model + {_size(optim)} optimizer state) and {kept}"
            f"{' plus the model-only export' if export_scale else ''}. Free space there, lower "
            f"checkpoint.keep_latest_k, or point checkpoint.folder (or job.dump_folder) at a bigger disk")
    if keep == 0 and free < 3 * one:
        logger.warning(f"checkpoint: {folder} has room for {int(free // one)} checkpoint(s) of about {_size(one)} "
                       f"and keep_latest_k=0 keeps every one: set checkpoint.keep_latest_k before the disk fills")
