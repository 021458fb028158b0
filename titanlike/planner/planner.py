"""The layout planner: every layout of a model on N GPUs that the config check accepts, ranked by predicted speed
(titanlike/planner/cost.py), the fastest checked for memory by the traced estimate (titanlike/planner/memory.py) until
`top` of them fit with a margin.

A candidate is the base config with parallelism / batch / AC / float8 / reshard keys changed; the config check
(titanlike/config/validate.py) and the family's own checks (ModelSpec.check) run on each, so no layout the planner
proposes fails at launch for a rule the trainer knows.

Its functions take the whole JobConfig on purpose: a candidate *is* a whole run's config, estimated and checked whole.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
from dataclasses import dataclass, field
from typing import Callable

import models
from models.common.masks import CP_METHODS
from titanlike.config import ConfigError, JobConfig
from titanlike.config.validate import validate, validate_model
from titanlike.planner.cost import Layout, Shape, step_seconds
from titanlike.planner.gpus import GpuKind

GIB = 2**30


@dataclass
class Candidate:
    overrides: dict[str, object]  # "section.key" -> value over the base config
    cfg: JobConfig
    layout: Layout
    cost: dict[str, float]
    peak_bytes: float | None = None  # traced estimate (the largest rank kind); None: not estimated
    lower_bound: float | None = None  # state_lower_bound, where it alone exceeded the budget (not traced)
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        lay = self.layout
        parts = [f"{k}={v}" for k, v in (("dp_replicate", lay.dp_replicate), ("dp_shard", lay.dp_shard),
                                          ("tp", lay.tp), ("pp", lay.pp), ("cp", lay.cp), ("ep", lay.ep)) if v > 1]
        parts += [f"cp_method={lay.cp_method}"] * (lay.cp > 1)
        parts += [f"mbs={lay.local_batch}", f"accum={lay.grad_accum}", f"ac={lay.ac}"]
        parts += ["float8"] * lay.float8 + ["no-reshard"] * (lay.dp_shard > 1 and not lay.reshard_after_forward)
        if lay.pp > 1:
            parts.append(self.cfg.parallelism.pp_schedule)
        return " ".join(parts)


def model_shape(cfg: JobConfig) -> tuple[Shape, object, object]:
    """The cost model's view of the config's model, from its ModelSpec (counts and shape)."""
    spec = models.get_spec(cfg.model.name)
    flavor = spec.flavor_args(cfg.model.flavor, cfg.model.args)
    run = {"max_seq_len": cfg.training.seq_len}
    if cfg.model.vocab_size > 0:
        run["vocab_size"] = cfg.model.vocab_size
    if cfg.model.n_layers > 0:
        run["n_layers"] = cfg.model.n_layers
    args = dataclasses.replace(flavor, **run)
    counts, widths = spec.param_counts(args), spec.shape(args)
    topk = widths.moe_topk
    float8_active, expert_active, experts, expert_params = _linear_and_expert_params(cfg, spec, args, topk)
    shape = Shape(params=counts.total, active=counts.active, dim=widths.dim, n_layers=widths.n_layers,
                  kv_dim=widths.kv_dim, moe_topk=topk, flops_per_token=spec.flops_per_token(args, cfg.training.seq_len),
                  float8_active=float8_active, expert_active=expert_active, moe_experts=experts,
                  expert_params=expert_params, kv_layers=widths.kv_layers, cp_a2a_layers=widths.cp_a2a_layers,
                  cp_a2a_dim=widths.cp_a2a_dim, qo_dim=widths.qo_dim, heads=widths.heads, kv_heads=widths.kv_heads)
    return shape, spec, args


def _linear_and_expert_params(cfg: JobConfig, spec, args, topk: int) -> tuple[int, int, int, int]:
    """(parameters a token passes through in the Linear layers float8 would convert, in the routed experts, the
    routed experts per MoE layer, all routed experts' parameters), read off the model built on the meta device (no
    memory)."""
    import torch
    from torch import nn

    from float8 import build_filter
    from models.common.moe import GroupedExperts

    with torch.device("meta"):
        model = spec.model_cls(args)
    f8 = cfg.float8
    keep = build_filter(list(f8.filter_fqns), f8.recipe, False)  # (filter_small needs torchao's H100 table)
    float8_active = sum(m.weight.numel() for n, m in model.named_modules() if isinstance(m, nn.Linear) and keep(m, n))
    grouped = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    expert_params = sum(p.numel() for m in grouped for p in m.parameters())
    expert_active = sum(sum(p.numel() for p in m.parameters()) * topk // m.num_experts for m in grouped)
    return float8_active, expert_active, (grouped[0].num_experts if grouped else 0), expert_params


def _divisors(n: int, cap: int) -> list[int]:
    return [d for d in (1, 2, 4, 8, 16, 32, 64) if d <= cap and n % d == 0]


def enumerate_layouts(base: JobConfig, world: int, gpu: GpuKind, *, allow_float8: bool = True,
                      max_local_batch: int = 32) -> list[Candidate]:
    """Every layout the config check accepts for `world` GPUs at the base's global batch and sequence length."""
    shape, spec, args = model_shape(base)
    t = base.training
    global_batch = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * world
    nodes = max(1, world // gpu.gpus_per_node)
    acs = ["none", "selective_op", "full"] + (["memory_budget:0.5"] if base.compile.enable else [])
    out = []
    for tp, pp, cp, rep in itertools.product(_divisors(world, gpu.gpus_per_node), _divisors(world, args.n_layers),
                                             _divisors(world, 8) if t.seq_len >= 8192 else [1],
                                             sorted({1, nodes})):
        if world % (tp * pp * cp * rep):
            continue
        shard = world // (tp * pp * cp * rep)
        dp = rep * shard
        eps = [e for e in _divisors(shard, 64) if shape.moe_topk] or [1]
        for ep, mbs, ac, f8, reshard in itertools.product(
                eps, [b for b in (1, 2, 4, 8, 16, 32) if b <= max_local_batch and global_batch % (b * dp) == 0],
                acs, [False, True] if allow_float8 and gpu.fp8_tflops > 0 else [False],
                [True, False] if shard * cp > 1 else [True]):
            over = {"parallelism.tp": tp, "parallelism.pp": pp, "parallelism.cp": cp, "parallelism.ep": ep,
                    "parallelism.dp_replicate": rep, "parallelism.dp_shard": shard,
                    "training.local_batch_size": mbs, "training.global_batch_size": global_batch,
                    "float8.enable": f8,
                    "parallelism.fsdp_reshard_after_forward": "default" if reshard else "never"}
            over.update(_ac_keys(ac))
            if cp > 1:  # the method that always passes the check; _fastest_cp_method picks among them below
                over["parallelism.cp_method"] = "allgather"
            if pp > 1:
                over.update({"parallelism.pp_schedule": "1F1B", "parallelism.pp_microbatches": mbs})
            cand = _checked(base, over, world, spec, args)
            if cand is None:
                continue
            lay = layout_of(cand, world)
            if cp > 1:
                cand, lay = _fastest_cp_method(cand, lay, over, shape, gpu, world, spec, args)
            out.append(Candidate(over, cand, lay, step_seconds(shape, lay, gpu)))
    return out


def _fastest_cp_method(cfg: JobConfig, lay: Layout, over: dict[str, object], shape: Shape, gpu: GpuKind, world: int,
                       spec, args) -> tuple[JobConfig, Layout]:
    """Under CP: the attention method (parallelism.cp_method) the cost model ranks fastest among those the config
    check accepts for this layout (alltoall needs cp to divide a TP rank's heads); set in `over` and the config.
    Ties keep the earlier of CP_METHODS (allgather first)."""
    best = None
    for method in CP_METHODS:
        trial = dataclasses.replace(lay, cp_method=method)
        seconds = step_seconds(shape, trial, gpu)["step"]
        if best is not None and seconds >= best[0]:
            continue
        checked = cfg if method == cfg.parallelism.cp_method else _checked(
            cfg, {"parallelism.cp_method": method}, world, spec, args)
        if checked is not None:
            best = (seconds, checked, trial)
    over["parallelism.cp_method"] = best[2].cp_method
    return best[1], best[2]


def layout_of(cfg: JobConfig, world: int) -> Layout:
    """The cost model's view of a (validated) config at `world` GPUs."""
    p, t, a = cfg.parallelism, cfg.training, cfg.activation_checkpoint
    shard = p.dp_shard if p.dp_shard > 0 else world // (p.dp_replicate * p.tp * p.pp * p.cp)
    dp = p.dp_replicate * shard
    gbs = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dp
    ac = {"none": "none", "full": "full"}.get(a.mode)
    if a.mode == "memory_budget":
        ac = f"memory_budget:{a.memory_budget}"
    elif a.mode == "selective":
        ac = (f"selective_every:{a.selective_option}" if a.selective_option.isdigit() else
              f"selective_{a.selective_option}")
    micro = p.pp_microbatches if p.pp_microbatches > 0 else t.local_batch_size
    return Layout(world=world, dp_replicate=p.dp_replicate, dp_shard=shard, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep,
                  local_batch=t.local_batch_size, grad_accum=max(1, gbs // (t.local_batch_size * dp)),
                  seq_len=t.seq_len, ac=ac, float8=cfg.float8.enable,
                  reshard_after_forward=p.fsdp_reshard_after_forward != "never",
                  pp_microbatches=micro if p.pp > 1 else 1,
                  pp_stages_per_rank=max(1, p.pp_stages_per_rank) if p.pp > 1 else 1, cp_method=p.cp_method)


def _ac_keys(ac: str) -> dict[str, object]:
    if ac.startswith("memory_budget:"):
        return {"activation_checkpoint.mode": "memory_budget",
                "activation_checkpoint.memory_budget": float(ac.split(":")[1])}
    if ac.startswith("selective_"):
        return {"activation_checkpoint.mode": "selective", "activation_checkpoint.selective_option": ac.split("_")[1]}
    return {"activation_checkpoint.mode": ac}


def _checked(base: JobConfig, over: dict[str, object], world: int, spec, args) -> JobConfig | None:
    cfg = copy.deepcopy(base)
    for dotted, value in over.items():
        section, key = dotted.split(".")
        setattr(getattr(cfg, section), key, value)
    try:
        validate(cfg, world)
        validate_model(spec, args, cfg.parallelism, cfg.model.flavor)
    except ConfigError:
        return None
    return cfg


# Bytes per parameter a rank holds at the optimizer step at the least: the weights (2, bf16; fp32 under FSDP), the
# gradients (2) and AdamW's two fp32 moments (8). With every parameter counted as sharded as far as it can be, this
# is a lower bound of any layout's peak that needs no trace.
MIN_STATE_BYTES_PER_PARAM = 12


def state_lower_bound(shape: Shape, lay: Layout) -> float:
    """Bytes per GPU of parameters, gradients and optimizer state under `lay`, at the least: dense parameters split
    over TP, PP and FSDP (dp_shard x cp), routed experts over PP and FSDP (EP ranks are a part of dp_shard; TP
    replicates experts); the largest pipeline stage holds at least the average."""
    shard = lay.dp_shard * lay.cp
    dense = (shape.params - shape.expert_params) / (lay.tp * lay.pp * shard)
    return MIN_STATE_BYTES_PER_PARAM * (dense + shape.expert_params / (lay.pp * shard))


def plan(base: JobConfig, world: int, gpu: GpuKind, memory_gib: float, estimate: Callable[[JobConfig, int], float],
         top: int = 5, margin: float = 0.05, max_estimates: int = 16, allow_float8: bool = True,
         log: Callable[[str], None] = logging.getLogger("titanlike").info,
         progress: Callable[[str], None] = lambda line: None) -> tuple[list[Candidate], list[Candidate]]:
    """(the `top` fastest layouts that fit memory_gib with `margin` to spare, every candidate ranked). `estimate`
    (cfg, world) -> peak bytes of the largest rank; it runs on the fastest candidates in order, at most
    `max_estimates` times. A candidate whose parameters, gradients and optimizer state alone exceed the budget
    (state_lower_bound) is not traced; one that cannot be estimated is logged in one line and skipped. `log` gets
    one line per candidate estimated or skipped, `progress` one before each estimate starts."""
    shape, _, _ = model_shape(base)
    ranked = sorted(enumerate_layouts(base, world, gpu, allow_float8=allow_float8),
                    key=lambda c: -c.cost["tokens_per_s_per_gpu"])
    budget = memory_gib * GIB * (1 - margin)
    fits: list[Candidate] = []
    pruned, tried = [], 0
    for cand in ranked:
        if tried == max_estimates or len(fits) == top:
            break
        bound = state_lower_bound(shape, cand.layout)
        if bound > budget:
            cand.lower_bound = bound
            pruned.append(cand)
            continue
        tried += 1
        progress(f"estimating {tried}/{max_estimates}: {cand.describe()}")
        try:
            cand.peak_bytes = estimate(cand.cfg, world)
        except Exception as e:  # noqa: BLE001 - an estimator gap on one layout must not end the plan
            first = (str(e).strip().splitlines() or [""])[0][:160]
            cand.notes.append(f"not estimated: {type(e).__name__}: {first}")
            log(f"  {cand.describe():<60} skipped: the estimate failed ({type(e).__name__}: {first})")
            continue
        log(f"  {cand.describe():<60} {cand.cost['tokens_per_s_per_gpu']:>9,.0f} tok/s/GPU predicted, "
            f"{cand.peak_bytes / GIB:6.1f} GiB")
        if cand.peak_bytes <= budget:
            fits.append(cand)
    if pruned:
        least = min(c.lower_bound for c in pruned)
        log(f"  {len(pruned)} layout(s) not traced: their parameters, gradients and optimizer state alone "
            f"need at least {least / GIB:,.1f} GiB per GPU (budget {budget / GIB:,.1f} GiB)")
    return fits, ranked


def overrides_toml(base_path: str, cand: Candidate, header: str) -> str:
    """A TOML that extends the base config with the candidate's keys."""
    from titanlike.config.load import _toml_value

    lines = [f"# {line}" for line in header.splitlines()] + [f'extends = "{base_path}"']
    by_section: dict[str, list[str]] = {}
    for dotted, value in cand.overrides.items():
        section, key = dotted.split(".")
        by_section.setdefault(section, []).append(f"{key} = {_toml_value(value)}")
    for section, keys in by_section.items():
        lines += ["", f"[{section}]", *keys]
    return "\n".join(lines) + "\n"
