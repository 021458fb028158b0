"""One simulated rank on this machine: torch's fake process group (collectives return at once, no peers) and
FakeTensorMode (tensors with shapes, dtypes and devices but no storage), so the real model under the real plan
can be built and stepped for a world of N ranks in seconds, without device memory.

Fake tensors trace on the "cpu" device: on a CPU-only torch, fake "cuda" tensors can be created, but the autograd
engine aborts the process on them (InputMetadata asks for a CUDA device guard, which a CPU build lacks). The
GPU's choices are therefore made explicitly where the code asks the device (`gpu_choices`): FSDP's bf16/fp32
MixedPrecisionPolicy from the config, the precision mode (autocast / master weights / FSDP), fused AdamW.
"""
from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import torch
import torch.distributed as dist


@contextlib.contextmanager
def fake_world(rank: int, world_size: int):
    """The default process group as rank `rank` of `world_size` over the fake backend; nothing for one rank (the
    trainer makes no group then either)."""
    if world_size <= 1:
        yield
        return
    if dist.is_initialized():
        raise RuntimeError("estimate_memory: this process already has a process group; run the estimate in a "
                           "process of its own (scripts/plan.py)")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    forget_dtensor_caches()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        forget_dtensor_caches()


def forget_dtensor_caches() -> None:
    """Empty DTensor's process-wide caches of sharding propagation and redistribution plans. A DeviceMesh compares
    equal to any mesh of the same shape, names and ranks, so a mesh of the next fake world (another rank of the same
    layout: a TP x PP stage; or the planner's next candidate) hits entries made in the previous one, and the specs
    they hand back carry the previous world's mesh, whose process groups no longer exist (or, by name, are now other
    groups). A real run has one world per process and never meets this. Each cache is looked up, since they differ
    between torch versions."""
    from torch.distributed.tensor import DTensor

    prop = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    for fn in (getattr(prop, "propagate_op_sharding", None), getattr(prop, "_propagate_tensor_meta_cached", None)):
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()
    if hasattr(torch._C, "_clear_DTensor_sharding_propagator_cache"):  # the C++ fast path's copy
        torch._C._clear_DTensor_sharding_propagator_cache()
    import torch.distributed.tensor._redistribute as redistribute

    if hasattr(redistribute, "clear_redistribute_planner_cache"):
        redistribute.clear_redistribute_planner_cache()
    if hasattr(getattr(redistribute, "_gen_transform_infos", None), "cache_clear"):
        redistribute._gen_transform_infos.cache_clear()


def fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def gpu_cfg(cfg):
    """The config the GPU would see where a key says "auto" by device: fused AdamW."""
    if cfg.optimizer.fused == "auto":
        cfg = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, fused="true"))
    return cfg


@contextlib.contextmanager
def gpu_choices(cfg, enabled: bool):
    """While building and tracing on fake CPU tensors, make the choices the trainer makes on a GPU: FSDP's
    param/reduce dtypes from training.mixed_precision_* (parallelize/fsdp.py picks fp32 on CPU) and the
    precision mode of a CUDA device (titanlike/optim/master_weights.py)."""
    if not enabled:
        yield
        return
    import parallelize.fsdp as fsdp_mod
    import titanlike.train.update as update_mod

    t = cfg.training
    dtypes = (getattr(torch, t.mixed_precision_param), getattr(torch, t.mixed_precision_reduce))
    orig_mode = update_mod.mixed_precision_mode
    with mock.patch.object(fsdp_mod, "fsdp_dtypes", lambda dims, training: dtypes), \
         mock.patch.object(update_mod, "mixed_precision_mode",
                           lambda t, comp, dims, device, **kw: orig_mode(t, comp, dims, torch.device("cuda"), **kw)):
        yield


@contextlib.contextmanager
def own_propagation_mode():
    """DTensor's sharding propagation runs each op once more on global-shaped fake tensors
    (ShardingPropagator._propagate_tensor_meta_non_cached) to learn its output's shape. Those shadows are not the
    run's memory, so the propagation runs with every dispatch mode set aside: the memory tracker does not see it, and
    torch's `detect_fake_mode() or FakeTensorMode()` there finds no mode and makes a fake mode of its own. (Patching
    only the fake mode it picks was enough on torch 2.13, whose tracker skips another fake mode's ops; torch 2.11's
    tracker counts them: a 4-layer 8B cut on 8 fake ranks showed 13 GiB of such "temporaries" in the optimizer step.)
    No-op where torch has no such method."""
    from torch.utils._python_dispatch import _disable_current_modes
    import torch.distributed.tensor._sharding_prop as sp

    cls = sp.ShardingPropagator
    orig = getattr(cls, "_propagate_tensor_meta_non_cached", None)
    if orig is None:
        yield
        return

    def propagate_aside(self, *args, **kwargs):
        with _disable_current_modes():
            return orig(self, *args, **kwargs)

    with mock.patch.object(cls, "_propagate_tensor_meta_non_cached", propagate_aside):
        yield


@contextlib.contextmanager
def quiet_trace():
    """Warnings the trace raises once per rank kind and candidate that say nothing about the layout:
      - DTensor's "random operators may not have complete support on cpu device mesh": the trace's mesh is on the
        CPU (module docstring); a GPU run's is not.
      - FSDP2's "returned a view tensor" for the embedding under TP: the run and the trace both quiet it where TP is
        applied (parallelize/tp.py's EMBEDDING_VIEW_WARNING says why)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support on cpu")
        yield
