"""Before a run allocates anything: will it fit? (`scripts/train.py` on a GPU, and `--dry-run` anywhere.)

The traced estimate (titanlike/planner/memory.py) of the config at its world size against the GPU's memory. When it
does not fit, the cheapest fix: the changes a user reaches for first (more activation checkpointing, a smaller
micro-batch with accumulation, the chunked loss, resharding after forward), each estimated, and of those that fit
the one the cost model (titanlike/planner/cost.py) predicts fastest. Whole JobConfigs in and out: a fix is a changed
run.
"""
from __future__ import annotations

import copy
import logging

from titanlike.config import JobConfig
from titanlike.planner.memory import MemoryEstimate, estimate_memory

GIB = 2**30
logger = logging.getLogger("titanlike")


def _with(cfg: JobConfig, **changes: object) -> JobConfig:
    out = copy.deepcopy(cfg)
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        setattr(getattr(out, section), key, value)
    return out


def candidate_fixes(cfg: JobConfig, world_size: int) -> list[tuple[str, JobConfig]]:
    """Changes that lower memory without changing what is trained (the global batch stays), mildest first."""
    t, ac, par = cfg.training, cfg.activation_checkpoint, cfg.parallelism
    fixes = []
    if ac.mode == "none":
        fixes.append(("--activation_checkpoint.mode=selective --activation_checkpoint.selective_option=op",
                      _with(cfg, activation_checkpoint__mode="selective",
                            activation_checkpoint__selective_option="op")))
    if ac.mode != "full":
        fixes.append(("--activation_checkpoint.mode=full", _with(cfg, activation_checkpoint__mode="full")))
    if t.loss_chunk_tokens == 0:
        fixes.append(("--training.loss_chunk_tokens=8192", _with(cfg, training__loss_chunk_tokens=8192)))
    if par.fsdp_reshard_after_forward == "never":
        fixes.append(("--parallelism.fsdp_reshard_after_forward=default",
                      _with(cfg, parallelism__fsdp_reshard_after_forward="default")))
    if t.local_batch_size > 1 and par.pp == 1:
        half = t.local_batch_size // 2
        dp = max(1, world_size // (par.tp * par.pp * par.cp))
        gbs = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dp
        fixes.append((f"--training.local_batch_size={half} --training.global_batch_size={gbs} (accumulation keeps "
                      f"the global batch)",
                      _with(cfg, training__local_batch_size=half, training__global_batch_size=gbs)))
        fixes.append((f"--activation_checkpoint.mode=full --training.local_batch_size={half} "
                      f"--training.global_batch_size={gbs}",
                      _with(cfg, activation_checkpoint__mode="full", training__local_batch_size=half,
                            training__global_batch_size=gbs)))
    return fixes


def cheapest_fix(cfg: JobConfig, world_size: int, budget_bytes: float, gpu_name: str = "h100"
                 ) -> tuple[str, MemoryEstimate] | None:
    """The fitting fix the cost model predicts fastest, with its estimate; None if none of them fits."""
    from titanlike.planner.cost import step_seconds
    from titanlike.planner.gpus import gpu_kind
    from titanlike.planner.planner import layout_of, model_shape

    shape, _, _ = model_shape(cfg)
    gpu = gpu_kind(gpu_name)
    best = None
    for text, fixed in candidate_fixes(cfg, world_size):
        try:
            est = estimate_memory(fixed, world_size)
        except Exception as e:  # noqa: BLE001 - a fix the estimator cannot trace is not offered
            logger.debug(f"memory estimate of the fix {text!r} failed: {e}")
            continue
        if est.peak > budget_bytes:
            continue
        speed = step_seconds(shape, layout_of(fixed, world_size), gpu)["tokens_per_s_per_gpu"]
        if best is None or speed > best[0]:
            best = (speed, text, est)
    return None if best is None else (best[1], best[2])


# Where the estimate was measured within 10% of the run (docs/benchmarks.md "Memory"): no TP, no float8 under
# compile, no gradient accumulation. Elsewhere it has been up to 44% high, so the trainer refuses a config there only
# when the estimate exceeds the GPU by more than that, and otherwise warns.
UNCERTAIN_OVER = 1.5


def uncertain(cfg: JobConfig, world_size: int) -> str | None:
    """Why the estimate of `cfg` is not yet trusted to 10%, or None."""
    from titanlike.planner.planner import layout_of

    lay = layout_of(cfg, world_size)
    f8 = cfg.float8.enable and cfg.compile.enable
    why = [w for w, on in (("TP", lay.tp > 1),
                           ("float8 with selective AC", f8 and cfg.activation_checkpoint.mode == "selective"),
                           ("gradient accumulation", lay.grad_accum > 1)) if on]
    return ", ".join(why) or None


def check_fits(cfg: JobConfig, world_size: int, gpu_mem_bytes: float, gpu_name: str = "h100",
               margin: float = 0.02) -> tuple[bool, str, MemoryEstimate]:
    """(fits, report, estimate): the breakdown, the verdict, and when it does not fit the cheapest fix or the
    smallest memory that would hold the config as it is."""
    est = estimate_memory(cfg, world_size)
    budget = gpu_mem_bytes * (1 - margin)
    need = est.peak / GIB
    report = [est.format()]
    if est.peak <= budget:
        report.append(f"fits: {need:.1f} GiB of {gpu_mem_bytes / GIB:.1f} GiB per GPU")
        return True, "\n".join(report), est
    fix = cheapest_fix(cfg, world_size, budget, gpu_name)
    advice = (f"the cheapest fix that fits: {fix[0]} ({fix[1].peak / GIB:.1f} GiB)" if fix is not None else
              f"none of more activation checkpointing, the chunked loss or a smaller micro-batch fits: shard over "
              f"more GPUs (parallelism.dp_shard, tp, pp) or use GPUs with at least {need:.1f} GiB")
    report.append(f"does not fit: needs {need:.1f} GiB per GPU, this GPU has {gpu_mem_bytes / GIB:.1f} GiB; "
                  f"{advice}")
    return False, "\n".join(report), est
