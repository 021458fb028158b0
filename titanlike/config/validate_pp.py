"""Pipeline-parallel config rules (called from validate.py); the stage arithmetic is parallelize/pp_split.py's."""
from __future__ import annotations

from titanlike.config.sections import JobConfig, Parallelism

from parallelize.pp_split import (  # noqa: F401  (re-read by the checks below)
    PP_SCHEDULES, SINGLE_STAGE_SCHEDULES, SPLIT_BACKWARD_SCHEDULES, V_SCHEDULES, pp_microbatches, pp_stage_count,
)


def _stages_per_rank_rule(par: Parallelism, stages: int, source: str, errors: list[str]) -> None:
    if stages % par.pp:
        errors.append(f"{source} gives {stages} pipeline stages, not a multiple of parallelism.pp={par.pp}; "
                      f"every PP rank must hold the same number of stages")
        return
    per_rank = stages // par.pp
    if par.pp_schedule in SINGLE_STAGE_SCHEDULES and per_rank != 1:
        errors.append(f"parallelism.pp_schedule={par.pp_schedule!r} runs one stage per rank but {source} gives "
                      f"{per_rank}; use Interleaved1F1B/LoopedBFS/InterleavedZeroBubble for several, or "
                      f"{par.pp} stages in all")
    if par.pp_schedule in V_SCHEDULES and per_rank != 2:
        errors.append(f"parallelism.pp_schedule={par.pp_schedule!r} needs exactly 2 stages per rank (V shape) but "
                      f"{source} gives {per_rank}; use {2 * par.pp} stages in all")


def check_pipeline(cfg: JobConfig, errors: list[str]) -> None:
    """Rules that need no model shapes. Schedule names are checked by validate.CHOICES."""
    par, tr = cfg.parallelism, cfg.training
    if par.pp_microbatches < 1 and par.pp_microbatches != -1:
        errors.append(f"parallelism.pp_microbatches={par.pp_microbatches} must be >= 1, or -1 for one sequence "
                      f"per micro-batch")
    for key in ("pp_stages_per_rank", "pp_layers_per_stage"):
        value = getattr(par, key)
        if value < 1 and value != -1:
            errors.append(f"parallelism.{key}={value} must be >= 1, or -1 (unset)")
    for key in ("pp_embedding_weight", "pp_output_weight"):
        value = getattr(par, key)
        if value < 0 and value != -1:
            errors.append(f"parallelism.{key}={value} must be >= 0 (layer equivalents), or -1 to estimate it")
    if par.pp <= 1 or errors or par.pp_schedule not in PP_SCHEDULES:
        return
    m = pp_microbatches(par, tr.local_batch_size)
    if tr.local_batch_size % m:
        errors.append(f"parallelism.pp_microbatches={m} must divide training.local_batch_size={tr.local_batch_size} "
                      f"(each micro-batch gets local_batch_size/pp_microbatches sequences)")
    given = [k for k in ("pp_split_points", "pp_layers_per_stage", "pp_stages_per_rank")
             if getattr(par, k) not in ([], -1)]
    if len(given) > 1:
        errors.append(f"set at most one of parallelism.{', parallelism.'.join(given)}: each decides the number of "
                      f"pipeline stages")
    elif par.pp_split_points:
        _stages_per_rank_rule(par, len(par.pp_split_points) + 1, "parallelism.pp_split_points", errors)
    elif par.pp_stages_per_rank > 0:
        _stages_per_rank_rule(par, par.pp * par.pp_stages_per_rank, "parallelism.pp_stages_per_rank", errors)
    ac = cfg.activation_checkpoint
    if par.pp_schedule in SPLIT_BACKWARD_SCHEDULES and ac.mode == "selective" and ac.selective_option == "op":
        errors.append(f"parallelism.pp_schedule={par.pp_schedule!r} runs two backward passes (input, then weight) "
                      f"over each block, which per-op selective activation checkpointing forbids; use "
                      f"activation_checkpoint.mode=\"full\" or selective_option=\"N\" (every N-th block), or 1F1B")
    if par.pp_schedule in SPLIT_BACKWARD_SCHEDULES and cfg.compile.enable and "model" in cfg.compile.components:
        errors.append(f"parallelism.pp_schedule={par.pp_schedule!r} splits the backward into input and weight "
                      f"passes, which torch.distributed.pipelining does not support through compiled blocks; set "
                      f"compile.enable=false (or compile.components=[\"loss\"]) or use 1F1B/Interleaved1F1B")


def check_pipeline_model(n_layers: int, par: Parallelism, flavor: str, errors: list[str]) -> None:
    """Rules that need the layer count: the stage count must fit the layers (`flavor`: model.flavor, for the
    message)."""
    if par.pp <= 1:
        return
    stages = pp_stage_count(par, n_layers)
    if stages > n_layers:
        per_rank = "" if stages == par.pp else f" with {stages} stages in all ({par.pp_schedule})"
        errors.append(f"parallelism.pp={par.pp}{per_rank} exceeds model.flavor {flavor!r}'s "
                      f"n_layers={n_layers}; each pipeline stage needs at least one layer: lower parallelism.pp or "
                      f"the stages per rank, or use a deeper flavor")
    elif par.pp_layers_per_stage > 0:
        _stages_per_rank_rule(par, stages, f"parallelism.pp_layers_per_stage={par.pp_layers_per_stage}", errors)
