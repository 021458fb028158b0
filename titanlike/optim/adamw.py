"""AdamW with Megatron-style weight-decay groups, and DTensor-aware gradient clipping (fused into AdamW when it can)."""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from titanlike.config.sections import Optimizer
from titanlike.optim.container import optimizers_of
from titanlike.optim.muon import build_muon


def param_groups(model: nn.Module, cfg: Optimizer) -> list[dict]:
    """Split parameters into decay / no-decay groups.

    1-D parameters (norm weights, biases) and embedding tables (nn.Embedding) are not decayed by default, as in
    GPT/Megatron: decaying a norm gain towards 0 or shrinking rarely-seen token rows only hurts.
    """
    decay, no_decay = [], []
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    # A tied copy held apart from its source (a pipeline stage's output.weight, model.tied_parameters) decays by its
    # source's rule, or the two copies would drift apart; where it *is* the source, named_parameters lists it once.
    copies_of = {copy: source for source, copy in getattr(model, "tied_parameters", ())}
    params = dict(model.named_parameters())
    for name, p in params.items():
        if not p.requires_grad:
            continue
        is_embedding = id(p) in embeddings or (name in copies_of and copies_of[name] not in params)
        is_1d = p.ndim < 2
        if (is_1d and not cfg.decay_norms_and_biases) or (is_embedding and not cfg.decay_embeddings):
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: nn.Module, cfg: Optimizer, device: torch.device,
                    io_modules: tuple[str, ...] = ()) -> torch.optim.Optimizer:
    """io_modules: the family's ModelSpec.input_modules + output_modules (Muon leaves them to AdamW)."""
    if cfg.name == "Muon":
        return build_muon(model, cfg, param_groups(model, cfg), io_modules)
    if cfg.name != "AdamW":
        raise ValueError(f"optimizer.name={cfg.name!r} is not supported; use 'AdamW' or 'Muon'")
    fused = device.type == "cuda" if cfg.fused == "auto" else cfg.fused == "true"
    # fused=True runs one kernel over all params (DTensors included); foreach is the fallback on CPU.
    kwargs = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(
        param_groups(model, cfg), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **kwargs
    )


def _placement_groups(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Indices of `tensors` grouped by (mesh, placements); plain tensors form one group of their own."""
    groups: dict = {}
    for i, t in enumerate(tensors):
        key = (t.device_mesh, tuple(t.placements)) if isinstance(t, DTensor) else None
        groups.setdefault(key, []).append(i)
    return list(groups.values())


@torch.no_grad()
def _sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """The squared L2 norm (fp32, a plain tensor, the same on every rank) of one (mesh, placements) group.

    DTensors: the local shards' sum of squares, all-reduced over each mesh dimension that shards them (Shard and
    FSDP's strided shards: each rank there holds other elements), one dimension at a time; a Partial dimension is
    reduced to Replicate first (its value is the sum over the dimension, not its shards). Not DTensor's own norm:
    its reduction merges all sharded dimensions into one collective over their flattened mesh, which torch 2.13 can
    form only for dimensions in the root mesh's order. The routed experts' mesh under EP with context parallel,
    (edp, ep), is not (edp holds cp, which lies after ep), and their norm raised "Invalid mesh_dim_names ('edp',
    'ep') specified. Mesh dim indices should be in ascending order" (tests/multiproc/sft_worker.py, moe_ep2_cp2)."""
    first = grads[0]
    if not isinstance(first, DTensor):
        return torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True).float() ** 2
    mesh, placements = first.device_mesh, first.placements
    if any(p.is_partial() for p in placements):  # e.g. TP's replicated LoRA adapters (parallelize/lora.py)
        whole = [Replicate() if p.is_partial() else p for p in placements]
        grads = [g.redistribute(mesh, whole) for g in grads]
    sq = torch.nn.utils.get_total_norm([g.to_local() for g in grads], norm_type=2.0, foreach=True).float() ** 2
    for dim, p in enumerate(placements):
        if not (p.is_replicate() or p.is_partial()):  # Shard, or FSDP's _StridedShard (not is_shard() in 2.13)
            dist.all_reduce(sq, group=mesh.get_group(dim))
    return sq


@torch.no_grad()
def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm of `grads` as a plain fp32 tensor, the same on every rank.

    Grads may be DTensors on different meshes and placements at once: TP-only params on the tp mesh, FSDP x TP
    params on the 2-D mesh, experts on (edp, ep), plain replicated tensors (norms without sequence parallel). So each
    (mesh, placements) group is reduced on its own (`_sum_of_squares`: shards summed over their mesh, replicated or
    plain values counted once), and the groups' squares are added locally.
    """
    if not grads:
        return torch.zeros(())
    return torch.stack([_sum_of_squares([grads[i] for i in idx]) for idx in _placement_groups(grads)]).sum().sqrt()


def fused_clip_optimizers(optimizer) -> list[torch.optim.Optimizer] | None:
    """The optimizers when every one is a fused Adam/AdamW (a container's `.optimizers` included), else None.

    Those take the clipping inside their kernel: `grad_scale` (the attribute GradScaler feeds them) divides every
    gradient on the fly, which saves clipping's separate read-modify-write of all fp32 gradients (12 GB per step
    on the 1.5B model, ~3% of an H100 step)."""
    opts = optimizers_of(optimizer)
    ok = all(isinstance(o, torch.optim.Adam) and o.defaults.get("fused") for o in opts)  # AdamW subclasses Adam
    return list(opts) if opts and ok else None


@torch.no_grad()
def clip_with_norm_(params: list[torch.Tensor], max_norm: float, total: torch.Tensor,
                    fused_into: list[torch.optim.Optimizer] | None = None,
                    loss_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Scale the gradients of `params` by min(max_norm / (norm + 1e-6), 1), `total` being their global norm, and
    return the norm.

    loss_scale (fp16, titanlike/optim/loss_scale.py): the gradients are that many times the true ones and `total`
    is their norm; they are divided by it in the same pass, and the true norm is returned (clipping reads it).
    fused_into (from `fused_clip_optimizers`): leave the gradients as they are and have those optimizers' next
    step divide them by the inverse factor inside their kernel: the same update up to rounding (1 ulp)."""
    if loss_scale is not None:
        total = total / loss_scale
    clip = max_norm > 0 and bool(params)
    if fused_into is not None:
        scale = torch.clamp((total.float() + 1e-6) / max_norm, min=1.0) if clip else None
        if loss_scale is not None:
            scale = loss_scale if scale is None else scale * loss_scale
        for opt in fused_into:
            opt.grad_scale = scale  # a 0-dim tensor: DTensor ops take it as replicated, like found_inf
        return total
    if not (clip or loss_scale is not None and params):
        return total
    factor = torch.clamp(max_norm / (total.float() + 1e-6), max=1.0) if clip else torch.ones_like(total.float())
    if loss_scale is not None:
        factor = factor / loss_scale
    for idx in _placement_groups([p.grad for p in params]):  # foreach kernels want one mesh per call
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for i in idx:
            by_dtype.setdefault(params[i].grad.dtype, []).append(params[i].grad)
        for grads in by_dtype.values():
            torch._foreach_mul_(grads, factor.to(grads[0].device))
    return total


@torch.no_grad()
def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float,
                    fused_into: list[torch.optim.Optimizer] | None = None,
                    loss_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Clip by the global L2 norm (see `grad_norm`, `clip_with_norm_`) and return it, without a host sync."""
    params = [p for p in params if p.grad is not None]
    return clip_with_norm_(params, max_norm, grad_norm([p.grad for p in params]), fused_into, loss_scale)
