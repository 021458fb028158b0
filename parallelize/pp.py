"""Pipeline parallelism: split a decoder into stages, place them on the PP ranks, build a torch pipelining schedule.

Model contract (models/llama3): top-level `tok_embeddings`, `layers` (an nn.ModuleDict with string keys), `norm`,
`output`, and a forward that skips a module set to None (hidden states in, hidden states out). A stage is a deep
copy of the meta model that keeps its own `layers` entries (the others are deleted, never renumbered) and sets the
modules it does not own to None, so every parameter keeps the full model's FQN and checkpoints reshard between PP
and non-PP layouts. The model code knows nothing about pipelining.

Split (stage_layout): evenly by cost, each block counting 1 and tok_embeddings / norm+output counting
`pp_embedding_weight` / `pp_output_weight` block-equivalents (estimated from FLOPs when -1): stage boundaries
are the cumulative-cost quantiles, each stage keeping at least one block; or at explicit `pp_split_points`.
Placement (stage_ids): "loop" (rank r holds stages r, r+pp, r+2pp, ...) or, for ZBVZeroBubble/DualPipeV, "V"
(rank r holds stages r and S-1-r, so the first and last stage share rank 0).
Each stage model then gets the per-stage plan (TP -> AC -> compile -> FSDP), a PipelineStage on the pp group, and
all local stages one schedule from torch.distributed.pipelining.
"""
from __future__ import annotations

import copy
import itertools
import logging
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as pp_schedules

from titanlike.config.validate_pp import PP_SCHEDULES, V_SCHEDULES, pp_microbatches, pp_stage_count

logger = logging.getLogger("titanlike")

INPUT_MODULES = ("tok_embeddings",)  # run before the blocks: live on the first stage
OUTPUT_MODULES = ("norm", "output")  # run after the blocks: live on the last stage


def schedule_class(name: str) -> type:
    """The torch.distributed.pipelining schedule class for a config name ("1F1B", "ZBVZeroBubble", ...)."""
    if name not in PP_SCHEDULES:
        raise ValueError(f"parallelism.pp_schedule={name!r} is not one of {', '.join(PP_SCHEDULES)}")
    cls = getattr(pp_schedules, f"Schedule{name}", None)
    if cls is None:  # e.g. DualPipeV on a torch that predates it
        raise ValueError(f"parallelism.pp_schedule={name!r}: this torch {torch.__version__} has no Schedule{name}; "
                         f"pick another schedule")
    return cls


def is_multi_stage(name: str) -> bool:
    return issubclass(schedule_class(name), pp_schedules.PipelineScheduleMulti)


# ----------------------------------------------------------------------------------------------------- the split
def estimate_weights(model: nn.Module, seq_len: int) -> tuple[float, float]:
    """(embedding, output) cost in block-equivalents from training FLOPs per token: a block costs
    6*params + 12*dim*seq_len (its matmuls and the attention scores), the output projection 6*dim*vocab;
    the embedding lookup does no matmul (0)."""
    blocks = [b for b in model.layers.values() if b is not None]
    output = getattr(model, "output", None)
    if not blocks or output is None:
        return 0.0, 0.0
    dim = output.weight.shape[1]
    block_flops = 6 * sum(p.numel() for p in blocks[0].parameters()) + 12 * dim * seq_len
    return 0.0, 6 * output.weight.numel() / block_flops


def split_layers(layer_names: list[str], num_stages: int, embedding_weight: float = 0.0,
                 output_weight: float = 0.0, owners: list[int] | None = None) -> list[list[str]]:
    """Contiguous groups of `layer_names`, one per stage, with near-equal cost (block = 1, plus the embedding
    weight on the first stage and the output weight on the last); every stage keeps at least one block.

    Stage s first ends where the cumulative cost is closest to (s+1)/num_stages of the total; then boundaries
    move one block at a time while that lowers (the busiest rank's total, the costliest stage, the spread):
    with several stages per rank (`owners[s]` = rank of stage s) the rank totals bound the throughput, and
    per-stage rounding can pile up on one rank."""
    n = len(layer_names)
    if num_stages < 1:
        raise ValueError(f"split_layers: num_stages must be >= 1, got {num_stages}")
    if num_stages > n:
        raise ValueError(f"{num_stages} pipeline stages for {n} layers: each stage needs at least one layer; lower "
                         f"parallelism.pp or the stages per rank (pp_stages_per_rank / pp_layers_per_stage)")
    total = n + embedding_weight + output_weight
    ends, prev = [], 0
    for s in range(num_stages - 1):
        target = (s + 1) * total / num_stages - embedding_weight  # blocks before this boundary
        end = math.floor(target + 0.5)
        end = min(max(end, prev + 1), n - (num_stages - 1 - s))  # >= 1 block here and in each later stage
        ends.append(end)
        prev = end
    bounds = [0, *ends, n]
    sizes = [bounds[s + 1] - bounds[s] for s in range(num_stages)]
    owners = owners if owners is not None else list(range(num_stages))

    def score(sizes: list[int]) -> tuple[float, float, float]:
        costs = [k + (embedding_weight if s == 0 else 0.0) + (output_weight if s == num_stages - 1 else 0.0)
                 for s, k in enumerate(sizes)]
        loads: dict[int, float] = {}
        for owner, cost in zip(owners, costs):
            loads[owner] = loads.get(owner, 0.0) + cost
        return round(max(loads.values()), 9), round(max(costs), 9), round(sum(c * c for c in costs), 9)

    best, improved = score(sizes), True
    while improved:  # strictly decreasing score over a finite set: terminates
        improved = False
        for b in range(num_stages - 1):
            for d in (1, -1):  # move one block across boundary b (stage b gains d)
                trial = sizes.copy()
                trial[b] += d
                trial[b + 1] -= d
                if min(trial[b], trial[b + 1]) >= 1 and score(trial) < best:
                    sizes, best, improved = trial, score(trial), True
    bounds = [0, *itertools.accumulate(sizes)]
    return [layer_names[bounds[s]:bounds[s + 1]] for s in range(num_stages)]


def split_at(layer_names: list[str], split_points: list[str]) -> list[list[str]]:
    """Groups of `layer_names` starting a new stage at each split point ("layers.8" or "8")."""
    index = {name: i for i, name in enumerate(layer_names)}
    starts = []
    for point in split_points:
        key = point.removeprefix("layers.")
        if key not in index:
            raise ValueError(f"parallelism.pp_split_points: {point!r} is not a layer of the model (layers.0 .. "
                             f"layers.{layer_names[-1]}); write split points as 'layers.N'")
        starts.append(index[key])
    if any(b <= a for a, b in zip([0, *starts], starts)):
        raise ValueError(f"parallelism.pp_split_points={split_points} must be strictly increasing and after "
                         f"layers.{layer_names[0]}: each stage needs at least one layer")
    bounds = [0, *starts, len(layer_names)]
    return [layer_names[a:b] for a, b in zip(bounds, bounds[1:])]


def stage_layout(model: nn.Module, par, seq_len: int) -> list[list[str]]:
    """Module FQNs of every stage, e.g. [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "norm", "output"]].

    `par` is the Parallelism config section (pp, pp_schedule, pp_split_points, pp_stages_per_rank, ...)."""
    known = {"layers", *INPUT_MODULES, *OUTPUT_MODULES}
    unknown = [name for name, _ in model.named_children() if name not in known]
    if unknown:
        raise ValueError(f"pipeline split: top-level modules {unknown} of {type(model).__name__} have no stage; "
                         f"parallelize/pp.py knows {sorted(known)} (add them to INPUT_MODULES or OUTPUT_MODULES)")
    layer_names = list(model.layers.keys())
    if par.pp_split_points:
        groups = split_at(layer_names, par.pp_split_points)
    else:
        auto_emb, auto_out = estimate_weights(model, seq_len)
        emb = auto_emb if par.pp_embedding_weight < 0 else par.pp_embedding_weight
        out = auto_out if par.pp_output_weight < 0 else par.pp_output_weight
        num_stages = pp_stage_count(par, len(layer_names))
        owners = stage_owners(par.pp, num_stages, par.pp_schedule in V_SCHEDULES) if num_stages % par.pp == 0 else None
        groups = split_layers(layer_names, num_stages, emb, out, owners)
    layout = [[f"layers.{name}" for name in group] for group in groups]
    layout[0][:0] = [m for m in INPUT_MODULES if getattr(model, m, None) is not None]
    layout[-1] += [m for m in OUTPUT_MODULES if getattr(model, m, None) is not None]
    return layout


def stage_owners(pp: int, num_stages: int, v_shape: bool) -> list[int]:
    """The pp rank of every stage: loop style s % pp; V style min(s, num_stages-1-s) (2 stages per rank)."""
    if num_stages % pp:
        raise ValueError(f"{num_stages} pipeline stages cannot be spread evenly over parallelism.pp={pp} ranks")
    if v_shape:
        if num_stages != 2 * pp:
            raise ValueError(f"V-shaped schedules need exactly 2 stages per rank, got {num_stages} stages for pp={pp}")
        return [min(s, num_stages - 1 - s) for s in range(num_stages)]
    return [s % pp for s in range(num_stages)]


def stage_ids(pp_rank: int, pp: int, num_stages: int, v_shape: bool) -> list[int]:
    """Stages held by `pp_rank`, in stage order: loop style r, r+pp, ...; V style r and num_stages-1-r."""
    return [s for s, owner in enumerate(stage_owners(pp, num_stages, v_shape)) if owner == pp_rank]


def stage_module(model: nn.Module, module_names: list[str]) -> nn.Module:
    """A deep copy of (meta) `model` that keeps only `module_names`; FQNs unchanged."""
    part = copy.deepcopy(model)
    keep = {name.split(".", 1)[1] for name in module_names if name.startswith("layers.")}
    for key in list(part.layers.keys()):
        if key not in keep:
            del part.layers[key]
    for name in (*INPUT_MODULES, *OUTPUT_MODULES):
        if name not in module_names and getattr(part, name, None) is not None:
            setattr(part, name, None)
    return part


# ----------------------------------------------------------------------------------------------------- the pipeline
@dataclass
class Pipeline:
    schedule: pp_schedules._PipelineSchedule
    stages: list[PipelineStage]  # this rank's stages, in stage order
    model_parts: list[nn.Module]  # their modules (stage.submod), after the per-stage plan
    layout: list[list[str]]  # module FQNs of every stage (all ranks)
    owners: list[int]  # pp rank (in the pp group) of every stage
    n_microbatches: int

    @property
    def has_first_stage(self) -> bool:
        return any(s.is_first for s in self.stages)

    @property
    def has_last_stage(self) -> bool:
        return any(s.is_last for s in self.stages)


def build_pipeline(model: nn.Module, dims, cfg, device: torch.device, loss_fn: Callable,
                   stage_plan: Callable) -> Pipeline:
    """Split meta `model` into stages, apply `stage_plan(part, dims, cfg)` (TP/AC/compile/FSDP) to this rank's
    stages and build the schedule named by parallelism.pp_schedule.

    `loss_fn(output, target) -> scalar` runs on the last stage once per micro-batch; its backward is the only
    gradient scaling (the schedule gets scale_grads=False), so normalise inside it. Materialise the returned
    model_parts (to_empty + init_weights) before the first schedule step."""
    par = cfg.parallelism
    pp_mesh = dims.get_mesh("pp")
    if pp_mesh is None:
        raise RuntimeError("build_pipeline: parallelism.pp > 1 needs ParallelDims.build_mesh() first")
    cls = schedule_class(par.pp_schedule)
    layout = stage_layout(model, par, cfg.training.seq_len)
    num_stages = len(layout)
    pp_rank = pp_mesh.get_local_rank()
    group = pp_mesh.get_group()
    owners = stage_owners(dims.pp, num_stages, par.pp_schedule in V_SCHEDULES)
    stages, parts = [], []
    for sid in (s for s, owner in enumerate(owners) if owner == pp_rank):
        part = stage_plan(stage_module(model, layout[sid]), dims, cfg)
        parts.append(part)
        stages.append(PipelineStage(part, sid, num_stages, device, group=group))
    n_mb = pp_microbatches(par, cfg.training.local_batch_size)
    if cfg.training.local_batch_size % n_mb:
        raise ValueError(f"parallelism.pp_microbatches={n_mb} must divide training.local_batch_size="
                         f"{cfg.training.local_batch_size}")
    multi = issubclass(cls, pp_schedules.PipelineScheduleMulti)
    if not multi and len(stages) != 1:
        raise ValueError(f"parallelism.pp_schedule={par.pp_schedule!r} runs one stage per rank, got {len(stages)}")
    try:
        schedule = cls(stages if multi else stages[0], n_microbatches=n_mb, loss_fn=loss_fn, scale_grads=False)
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"parallelism.pp_schedule={par.pp_schedule!r} with pp_microbatches={n_mb} and "
                         f"{num_stages} stages over pp={dims.pp}: {e}") from e
    for sid, names in enumerate(layout):
        logger.info(f"pp stage {sid} on pp rank {owners[sid]}: {_describe(names)}")
    logger.info(f"pp schedule {par.pp_schedule}: {num_stages} stages over {dims.pp} ranks, {n_mb} micro-batches "
                f"of {cfg.training.local_batch_size // n_mb}; this rank holds stages {[s.stage_index for s in stages]}")
    return Pipeline(schedule, stages, parts, layout, owners, n_mb)


def _describe(names: list[str]) -> str:
    layers = [n.split(".", 1)[1] for n in names if n.startswith("layers.")]
    others = [n for n in names if not n.startswith("layers.")]
    span = f"layers.{layers[0]}..{layers[-1]}" if len(layers) > 1 else f"layers.{layers[0]}"
    return " + ".join([*[o for o in others if o in INPUT_MODULES], span, *[o for o in others if o in OUTPUT_MODULES]])
