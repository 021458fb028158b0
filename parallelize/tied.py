"""Tied parameters across pipeline stages, as Megatron does with the word embeddings of the first and last stage.

A model names its ties as (source FQN, copy FQN) pairs in `model.tied_parameters` (models/gpt: the output projection
tied to the token embedding). In one module the copy *is* the source. A pipeline stage is a deep copy of the model
that drops the modules of other stages (parallelize/pp.py), so the stage holding the copy but not the source keeps
the copy as its own parameter, under its own FQN:
- init: seeded_init draws the copy from the source's FQN (titanlike/distributed/seeded_init.py), so both start equal;
- each step, after the schedule's backward and before clipping, `TiedParameters.sync_grads()` sums the two
  gradients over the ranks holding them (the "embedding group": the pipeline ranks of the two stages at the same
  data/context/tensor-parallel coordinates, whose FSDP/TP shards are the same slices), so both get the full
  gradient and the same update;
- the grad norm counts the tied weight once: `norm_excluded()` are the copies (Megatron drops the shared copy from
  its norm too); they are still clipped by the same factor;
- checkpoints: the source's stage saves the source's FQN, the copy's stage the copy's, equal values: the keys of
  the one-module model, whose state dict lists both FQNs for the one tensor. Either layout loads the other's.
Two stages of one rank (V schedules: rank 0 holds the first and last stage) sum their gradients locally.

A top-level module listed on two stages of the layout (a model's `last_stage_modules` reads: multi-token prediction
embeds the next tokens on the last stage, parallelize/pp.py:model_layout) is the same tie with source FQN = copy FQN:
each of its parameters is a pair, the first stage's the source. Both stages save it under that one FQN with equal
values, so checkpoints are those of the one-module model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


@dataclass
class TiedPair:
    source: str  # FQN of the parameter the model ties to (held by `source_stage`)
    copy: str  # FQN of the tied copy (held by `copy_stage`)
    source_stage: int
    copy_stage: int


def stage_of(fqn: str, layout: list[list[str]]) -> int:
    """The stage whose module list holds the module of parameter `fqn` ("layers.3.x.weight" -> layers.3's)."""
    for sid, names in enumerate(layout):
        if any(fqn.startswith(name + ".") for name in names):
            return sid
    raise ValueError(f"tied parameter {fqn!r} is in no pipeline stage ({layout})")


def tied_pairs(model: nn.Module, layout: list[list[str]]) -> list[TiedPair]:
    """The model's ties (`tied_parameters`) whose two parameters land on different stages of `layout`."""
    pairs = []
    for source, copy in getattr(model, "tied_parameters", ()):
        a, b = stage_of(source, layout), stage_of(copy, layout)
        if a != b:
            pairs.append(TiedPair(source, copy, a, b))
    top = [name for names in layout for name in names if not name.startswith("layers.")]
    for name in dict.fromkeys(top):  # a module held by several stages: each copy tied to the first stage's
        held = [sid for sid, names in enumerate(layout) if name in names]
        for other in held[1:]:
            pairs += [TiedPair(fqn, fqn, held[0], other) for fqn, _ in getattr(model, name).named_parameters(name)]
    return pairs


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class TiedParameters:
    """The split ties of one pipeline: their process groups (built once, from the world mesh) and the gradient sum.

    `parts` maps each of this rank's stage ids to its stage module; `owners[s]` is the pp rank holding stage s.
    Every rank must build it (process-group creation is collective over the world)."""

    def __init__(self, pairs: list[TiedPair], parts: dict[int, nn.Module], owners: list[int], world_mesh):
        self.pairs = pairs
        # Parameters are looked up by FQN at each use: materialising the stages (to_empty) replaces them.
        self.local: list[tuple[nn.Module, str, nn.Module, str]] = []  # both on this rank: (part, fqn) twice
        self.remote: list[tuple[nn.Module, str, dist.ProcessGroup]] = []  # one here, the other on a pp peer
        self.copies: list[tuple[nn.Module, str]] = []  # this rank's copies: left out of the grad norm
        groups: dict[tuple[int, int], dist.ProcessGroup | None] = {}
        for pair in pairs:
            a, b = owners[pair.source_stage], owners[pair.copy_stage]
            src, dst = parts.get(pair.source_stage), parts.get(pair.copy_stage)
            if dst is not None:
                self.copies.append((dst, pair.copy))
            if a == b:
                if src is not None:
                    self.local.append((src, pair.source, dst, pair.copy))
                continue
            if (a, b) not in groups:
                groups[(a, b)] = _pair_group(world_mesh, a, b)
            if src is not None:
                self.remote.append((src, pair.source, groups[(a, b)]))
            elif dst is not None:
                self.remote.append((dst, pair.copy, groups[(a, b)]))
        self._check_shards()

    def _check_shards(self) -> None:
        """The two copies must be sliced alike (same global shape, placements and local shape) on each pair."""
        for src, src_fqn, dst, dst_fqn in self.local:
            a, b = _describe(_param(src, src_fqn)), _describe(_param(dst, dst_fqn))
            if a != b:
                raise ValueError(f"tied parameters sliced differently on two stages: {a} vs {b}")
        for part, fqn, group in self.remote:
            theirs = [None, None]
            dist.all_gather_object(theirs, _describe(_param(part, fqn)), group=group)
            if theirs[0] != theirs[1]:
                raise ValueError(f"tied parameters sliced differently on the first and last pipeline stage: "
                                 f"{theirs[0]} vs {theirs[1]}; give both modules the same TP/FSDP placement")

    def __bool__(self) -> bool:
        return bool(self.pairs)

    def norm_excluded(self) -> set[int]:
        """ids of this rank's copies: the grad norm counts each tied weight once (its source)."""
        return {id(_param(part, fqn)) for part, fqn in self.copies}

    @torch.no_grad()
    def sync_grads(self) -> None:
        """Sum each tied pair's gradients into both (a missing gradient counts as zero)."""
        for src_part, src_fqn, dst_part, dst_fqn in self.local:
            src, dst = _param(src_part, src_fqn), _param(dst_part, dst_fqn)
            total = _grad(src) + _grad(dst)
            src.grad, dst.grad = total, total.clone()
        for part, fqn, group in self.remote:
            p = _param(part, fqn)
            g = _grad(p)
            dist.all_reduce(_local(g), group=group)
            p.grad = g


def _param(part: nn.Module, fqn: str) -> nn.Parameter:
    for name, p in part.named_parameters():
        if name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "") == fqn:
            return p
    raise KeyError(f"tied parameter {fqn!r} is not in its pipeline stage's module")


def _describe(p: torch.Tensor) -> str:
    if isinstance(p, DTensor):
        return f"shape {tuple(p.shape)} local {tuple(p.to_local().shape)} placements {tuple(p.placements)} on " \
               f"mesh {p.device_mesh.mesh.shape} {p.device_mesh.mesh_dim_names}"
    return f"shape {tuple(p.shape)}"


def _grad(p: nn.Parameter) -> torch.Tensor:
    """p's gradient (zeros if none) laid out as p, so the two copies' local shards are the same slices (a TP
    embedding's gradient may come back replicated or partial while its weight is vocabulary-sharded)."""
    if p.grad is None:
        return torch.zeros_like(p)
    g = p.grad
    if isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
        g = g.redistribute(p.device_mesh, p.placements)
    return g


def _pair_group(world_mesh, a: int, b: int) -> dist.ProcessGroup | None:
    """This rank's group of the pipeline ranks `a` and `b` at its own coordinates on the other mesh axes (every
    rank calls new_group for every pair, in the same order; a rank outside both gets None)."""
    names = world_mesh.mesh_dim_names or ()
    if not names or names[0] != "pp":
        raise RuntimeError(f"tied parameters across pipeline stages: the world mesh's outermost axis must be pp, "
                           f"got {names}")
    grid = world_mesh.mesh.reshape(world_mesh.mesh.shape[0], -1)  # [pp, everything else] global ranks
    me, mine = dist.get_rank(), None
    for col in range(grid.shape[1]):
        ranks = [int(grid[a, col]), int(grid[b, col])]
        group = dist.new_group(ranks)
        if me in ranks:
            mine = group
    return mine
