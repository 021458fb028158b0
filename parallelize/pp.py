"""Pipeline parallelism: split a decoder into stages, place them on the PP ranks, build a torch pipelining schedule.

Model contract (models/spec.py): `layers` (an nn.ModuleDict with string keys), the top-level modules the ModelSpec
names as running before (input_modules) and after (output_modules) the blocks, and a forward that skips a
module set to None (hidden states in, hidden states out). A stage is a deep
copy of the meta model that keeps its own `layers` entries (the others are deleted, never renumbered) and sets the
modules it does not own to None, so every parameter keeps the full model's FQN and checkpoints reshard between PP
and non-PP layouts. The model code knows nothing about pipelining.

Where the boundaries go and which rank holds which stage: parallelize/pp_split.py (from the ModelSpec's pp_costs).
Each stage model then gets the per-stage plan (TP -> AC -> compile -> FSDP), a PipelineStage on the pp group, and
all local stages one schedule from torch.distributed.pipelining.
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as pp_schedules

from parallelize.pp_split import PP_SCHEDULES, V_SCHEDULES, pp_microbatches, stage_layout, stage_owners
from parallelize.sections import PlanSections

logger = logging.getLogger("titanlike")



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


def stage_module(model: nn.Module, module_names: list[str], top_level: tuple[str, ...]) -> nn.Module:
    """A deep copy of (meta) `model` that keeps only `module_names`; the `top_level` modules it does not keep
    become None. FQNs unchanged."""
    part = copy.deepcopy(model)
    keep = {name.split(".", 1)[1] for name in module_names if name.startswith("layers.")}
    for key in list(part.layers.keys()):
        if key not in keep:
            del part.layers[key]
    for name in (*top_level, *getattr(model, "last_stage_modules", {})):
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


def model_layout(model: nn.Module, spec, args, par, seq_len: int) -> list[list[str]]:
    """Module FQNs of every stage of meta `model` (a `spec` family model built from `args`)."""
    tail = getattr(model, "last_stage_modules", {})  # e.g. MTP, and the embedding it reads (models/common/decoder.py)
    known = {"layers", *spec.input_modules, *spec.output_modules, *tail}
    unknown = [name for name, _ in model.named_children() if name not in known]
    if unknown:
        raise ValueError(f"pipeline split: top-level modules {unknown} of {type(model).__name__} have no stage; "
                         f"add them to the ModelSpec's input_modules or output_modules ({spec.name})")
    present = [m for m in (*spec.input_modules, *spec.output_modules) if getattr(model, m, None) is not None]
    layout = stage_layout(list(model.layers.keys()), par, spec.pp_costs(args, seq_len),
                          [m for m in spec.input_modules if m in present],
                          [m for m in spec.output_modules if m in present])
    # The last stage also runs the model's last_stage_modules and holds copies of what they read from another stage
    # (the same FQNs: parallelize/tied.py pairs a module listed on two stages and sums its gradients).
    for name, reads in tail.items():
        layout[-1] += [m for m in (name, *reads) if m not in layout[-1]]
    return layout


def build_pipeline(model: nn.Module, spec, args, dims, sections: PlanSections, device: torch.device,
                   loss_fn: Callable, stage_plan: Callable) -> Pipeline:
    """Split meta `model` (built by ModelSpec `spec` from `args`) into stages, apply `stage_plan(part, dims, sections)`
    (TP/AC/compile/FSDP) to this rank's stages and build the schedule named by parallelism.pp_schedule.

    `loss_fn(output, target) -> scalar` runs on the last stage once per micro-batch; its backward is the only
    gradient scaling (the schedule gets scale_grads=False), so normalise inside it. Materialise the returned
    model_parts (to_empty + init_weights) before the first schedule step."""
    par, t = sections.parallelism, sections.training
    pp_mesh = dims.get_mesh("pp")
    if pp_mesh is None:
        raise RuntimeError("build_pipeline: parallelism.pp > 1 needs ParallelDims.build_mesh() first")
    cls = schedule_class(par.pp_schedule)
    layout = model_layout(model, spec, args, par, t.seq_len)
    num_stages = len(layout)
    pp_rank = pp_mesh.get_local_rank()
    group = pp_mesh.get_group()
    owners = stage_owners(dims.pp, num_stages, par.pp_schedule in V_SCHEDULES)
    stages, parts = [], []
    for sid in (s for s, owner in enumerate(owners) if owner == pp_rank):
        top_level = (*spec.input_modules, *spec.output_modules)
        part = stage_plan(stage_module(model, layout[sid], top_level), dims, sections)
        parts.append(part)
        stages.append(PipelineStage(part, sid, num_stages, device, group=group))
    n_mb = pp_microbatches(par, t.local_batch_size)
    if t.local_batch_size % n_mb:
        raise ValueError(f"parallelism.pp_microbatches={n_mb} must divide training.local_batch_size="
                         f"{t.local_batch_size}")
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
                f"of {t.local_batch_size // n_mb}; this rank holds stages {[s.stage_index for s in stages]}")
    return Pipeline(schedule, stages, parts, layout, owners, n_mb)


def _describe(names: list[str]) -> str:
    """"tok_embeddings + layers.0..3": the stage's modules in order, its blocks as a span."""
    layers = [n.split(".", 1)[1] for n in names if n.startswith("layers.")]
    first = names.index(f"layers.{layers[0]}")
    span = f"layers.{layers[0]}..{layers[-1]}" if len(layers) > 1 else f"layers.{layers[0]}"
    return " + ".join([*names[:first], span, *names[first + len(layers):]])
