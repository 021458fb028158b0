"""Where a pipeline's stage boundaries go, and which rank holds each stage: plain arithmetic on layer names and costs
(no torch), shared by config validation and parallelize/pp.py.

Split (stage_layout): evenly by cost (the model's ModelSpec.pp_costs: FLOPs per block, plus the modules before and
after the blocks, or `pp_embedding_weight` / `pp_output_weight` block-equivalents when set): stage boundaries are the
cumulative-cost quantiles, each stage keeping at least one block; or at explicit `pp_split_points`.
Placement (stage_ids): "loop" (rank r holds stages r, r+pp, r+2pp, ...) or, for ZBVZeroBubble/DualPipeV, "V"
(rank r holds stages r and S-1-r, so the first and last stage share rank 0).
"""
from __future__ import annotations

import itertools
import math

# Names as `torch.distributed.pipelining.get_schedule_class` spells them.
PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")  # exactly one stage per rank
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")  # two stages per rank, placed in a V (rank r: stages r and S-1-r)
# Split the backward into input-grad (I) and weight-grad (W) passes by walking the autograd graph; torch's
# pipelining does not support that through compiled graphs.
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def pp_microbatches(par, local_batch_size: int) -> int:
    """Micro-batches per schedule step: pp_microbatches, or one sequence each (-1)."""
    return local_batch_size if par.pp_microbatches == -1 else par.pp_microbatches


def pp_stage_count(par, n_layers: int | None = None) -> int:
    """Total pipeline stages over all PP ranks (pp * stages per rank)."""
    if par.pp_split_points:
        return len(par.pp_split_points) + 1
    if par.pp_layers_per_stage > 0:
        if n_layers is None:
            raise ValueError("pp_stage_count: n_layers is needed with parallelism.pp_layers_per_stage")
        return math.ceil(n_layers / par.pp_layers_per_stage)
    if par.pp_stages_per_rank > 0:
        return par.pp * par.pp_stages_per_rank
    return par.pp * (1 if par.pp_schedule in SINGLE_STAGE_SCHEDULES else 2)


def split_layers(layer_names: list[str], num_stages: int, embedding_weight: float = 0.0,
                 output_weight: float = 0.0, owners: list[int] | None = None,
                 layer_costs: list[float] | None = None) -> list[list[str]]:
    """Contiguous groups of `layer_names`, one per stage, with near-equal cost (each block its `layer_costs` entry,
    1 by default, plus the embedding weight on the first stage and the output weight on the last); every stage
    keeps at least one block.

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
    prefix = [0.0, *itertools.accumulate(layer_costs if layer_costs is not None else [1.0] * n)]
    total = prefix[n] + embedding_weight + output_weight
    ends, prev = [], 0
    for s in range(num_stages - 1):
        target = (s + 1) * total / num_stages - embedding_weight  # block cost before this boundary
        # The boundary whose cumulative cost is nearest the target (ties: the later one).
        end = min(range(n + 1), key=lambda k: (abs(prefix[k] - target), -k))
        end = min(max(end, prev + 1), n - (num_stages - 1 - s))  # >= 1 block here and in each later stage
        ends.append(end)
        prev = end
    bounds = [0, *ends, n]
    sizes = [bounds[s + 1] - bounds[s] for s in range(num_stages)]
    owners = owners if owners is not None else list(range(num_stages))

    def score(sizes: list[int]) -> tuple[float, float, float]:
        edges = [0, *itertools.accumulate(sizes)]
        costs = [prefix[edges[s + 1]] - prefix[edges[s]] + (embedding_weight if s == 0 else 0.0)
                 + (output_weight if s == num_stages - 1 else 0.0) for s in range(num_stages)]
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


def stage_layout(layer_names: list[str], par, costs, input_modules: list[str],
                 output_modules: list[str]) -> list[list[str]]:
    """Module FQNs of every stage, e.g. [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "norm", "output"]].

    `par` is the Parallelism config section (pp, pp_schedule, pp_split_points, pp_stages_per_rank, ...); `costs`
    the model's PipelineCosts (models/spec.py); `input_modules` / `output_modules` the top-level modules that run
    before / after the blocks (on the first / last stage)."""
    if par.pp_split_points:
        groups = split_at(layer_names, par.pp_split_points)
    else:
        unit = sum(costs.layers[k] for k in layer_names) / len(layer_names)  # cost in block-equivalents
        emb = costs.embedding / unit if par.pp_embedding_weight < 0 else par.pp_embedding_weight
        out = costs.output / unit if par.pp_output_weight < 0 else par.pp_output_weight
        num_stages = pp_stage_count(par, len(layer_names))
        owners = stage_owners(par.pp, num_stages, par.pp_schedule in V_SCHEDULES) if num_stages % par.pp == 0 else None
        groups = split_layers(layer_names, num_stages, emb, out, owners, [costs.layers[k] / unit for k in layer_names])
    layout = [[f"layers.{name}" for name in group] for group in groups]
    layout[0][:0] = list(input_modules)
    layout[-1] += list(output_modules)
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
