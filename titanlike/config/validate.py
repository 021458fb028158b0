"""Every cross-field rule of the config, in one place.

`validate` collects all problems and raises one ConfigError listing them, each naming the key(s) and the fix, so a
user fixes a config in one round trip. Types were already checked by the loader; this file checks values.
"""
from __future__ import annotations

import difflib
import importlib.util
import math
import os
from typing import Any

from float8 import RECIPES as FLOAT8_RECIPES
from float8 import config_problems as float8_config_problems
from models.common.backends import ATTN_BACKENDS, MASK_KERNEL_CHOICES, MIXER_KERNELS
from parallelize.ac import AC_MODES
from parallelize.compile import BACKENDS as COMPILE_BACKENDS
from parallelize.compile import COMPONENTS as COMPILE_COMPONENTS
from parallelize.fsdp import RESHARD_MODES
from titanlike.config.errors import ConfigError
from titanlike.config.sections import JobConfig, Parallelism, Training
from titanlike.config.validate_cp import check_cp, check_cp_model
from titanlike.config.validate_data import advise_data, check_data
from titanlike.config.validate_dpo import check_dpo
from titanlike.config.validate_eval import check_eval
from titanlike.config.validate_float8 import check_float8_experts, check_float8_experts_model
from titanlike.config.validate_lora import check_lora, check_lora_model, lora_advice
from titanlike.config.validate_pp import PP_SCHEDULES, check_pipeline, check_pipeline_model

# Allowed values of string "choice" fields. A value a consumer defines (attention kernels, AC modes, ...) is read
# from that consumer, so the two can never disagree; the rest are defined here.
CHOICES: dict[str, tuple[str, ...]] = {
    "model.attn_backend": ATTN_BACKENDS,
    "model.mask_kernel": MASK_KERNEL_CHOICES,
    "model.mixer_kernel": MIXER_KERNELS,
    "training.device": ("auto", "cpu", "cuda"),
    "training.mixed_precision_param": ("bfloat16", "float16", "float32"),
    "training.mixed_precision_reduce": ("bfloat16", "float16", "float32"),
    "training.mixed_precision_impl": ("auto", "autocast", "master_weights"),
    "optimizer.name": ("AdamW", "Muon"),
    "optimizer.muon_ns_dtype": ("bfloat16", "float32"),
    "optimizer.muon_lr_scale": ("match_rms_adamw", "original", "none"),  # titanlike/optim/muon.py: lr_scale
    "metrics.log_format": ("titanlike", "megatron"),
    "optimizer.fused": ("auto", "true", "false"),
    "lr_scheduler.decay_type": ("cosine", "linear", "wsd", "constant"),
    "lr_scheduler.on_steps_change": ("stretch", "keep"),
    "parallelism.fsdp_reshard_after_forward": RESHARD_MODES,
    "parallelism.pp_schedule": PP_SCHEDULES,
    "activation_checkpoint.mode": AC_MODES,
    "float8.recipe": FLOAT8_RECIPES,
    "checkpoint.async_mode": ("auto", "disabled", "async", "async_with_pinned_mem"),
    "checkpoint.export_dtype": ("float32", "bfloat16", "float16"),
    "fault_tolerance.process_group": ("auto", "gloo", "nccl"),
}
_DEGREES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # the mesh axes whose product is the world size


def _get(cfg: JobConfig, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def resolve_dp_shard(par, world_size: int) -> int:
    """dp_shard with -1 replaced by what the world size leaves after the other degrees; ConfigError if impossible.
    `par` is anything with the degree attributes (the [parallelism] section, ParallelDims)."""
    dp_shard, errors = check_degrees(par, world_size)
    if errors:
        raise ConfigError(errors[0])
    return dp_shard


def check_degrees(par, world_size: int | None) -> tuple[int | None, list[str]]:
    """(dp_shard resolved, problems) for the parallel degrees of `par` (the [parallelism] section or ParallelDims):
    each >= 1 (dp_shard -1 fills the world), their product the world size, ep dividing the ranks it borrows.
    The one copy of these rules: ParallelDims calls it too."""
    errors: list[str] = []
    for name in ("dp_replicate", "tp", "pp", "cp", "ep"):
        value = getattr(par, name)
        if not isinstance(value, int) or isinstance(value, bool):
            errors.append(f"parallelism.{name}={value!r} must be an integer")
        elif value < 1:
            errors.append(f"parallelism.{name}={value} must be >= 1 (1 = not used)")
    if not isinstance(par.dp_shard, int) or (par.dp_shard < 1 and par.dp_shard != -1):
        errors.append(f"parallelism.dp_shard={par.dp_shard!r} must be >= 1, or -1 to fill the remaining ranks")
    if errors:
        return None, errors
    if world_size is None:
        return (None if par.dp_shard == -1 else par.dp_shard), errors
    others = par.pp * par.dp_replicate * par.cp * par.tp
    dp_shard = par.dp_shard
    if dp_shard == -1:
        if world_size % others:
            formula = "*".join(str(getattr(par, d)) for d in _DEGREES if d != "dp_shard")
            return None, [f"parallelism.dp_shard=-1 fills the world, but world_size {world_size} is not divisible by "
                          f"pp*dp_replicate*cp*tp = {formula} = {others}; choose degrees whose product divides "
                          f"{world_size}, or set parallelism.dp_shard explicitly"]
        dp_shard = world_size // others
    product = others * dp_shard
    if product != world_size:
        formula = "*".join(str(dp_shard if d == "dp_shard" else getattr(par, d)) for d in _DEGREES)
        errors.append(
            f"parallelism degrees pp*dp_replicate*dp_shard*cp*tp = {formula} = {product}, but world_size is "
            f"{world_size}; change the degrees so the product is {world_size}, or set parallelism.dp_shard=-1")
    # Expert parallel borrows its ranks from the FSDP ranks (titanlike/distributed/parallel_dims.py), so it must
    # divide them.
    if par.ep > 1 and dp_shard % par.ep:
        errors.append(f"parallelism.ep={par.ep} must divide parallelism.dp_shard={dp_shard} (the experts are spread "
                      f"over ranks borrowed from the FSDP axis); choose an ep that divides it")
    return dp_shard, errors


def _check_parallelism(par, world_size: int | None, errors: list[str]) -> int | None:
    """Append degree errors; return the resolved dp_shard when it is known."""
    dp_shard, problems = check_degrees(par, world_size)
    errors.extend(problems)
    return dp_shard


def _check_choices(cfg: JobConfig, errors: list[str]) -> None:
    for dotted, allowed in CHOICES.items():
        value = _get(cfg, dotted)
        if value not in allowed:
            close = difflib.get_close_matches(str(value), allowed, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            errors.append(f"{dotted}={value!r} is not one of {', '.join(allowed)}{hint}")
    opt = cfg.activation_checkpoint.selective_option
    if opt not in ("op", "attention") and not (opt.isdigit() and int(opt) > 0):
        errors.append(f"activation_checkpoint.selective_option={opt!r} must be \"op\" (save matmul/attention "
                      f"outputs), \"attention\" (save attention outputs only) or a positive integer string like "
                      f"\"2\" (checkpoint every 2nd block)")
    bad = [c for c in cfg.compile.components if c not in COMPILE_COMPONENTS]
    if bad:
        errors.append(f"compile.components has {bad}; allowed: {', '.join(COMPILE_COMPONENTS)}")
    if cfg.compile.backend not in COMPILE_BACKENDS:
        errors.append(f"compile.backend={cfg.compile.backend!r} is not a torch.compile backend here; use one of "
                      f"{', '.join(COMPILE_BACKENDS)}")


def _check_numbers(cfg: JobConfig, errors: list[str]) -> None:
    opt = cfg.optimizer

    def at_least(dotted: str, low: float, why: str = "") -> None:
        value = _get(cfg, dotted)
        if value < low:
            errors.append(f"{dotted}={value} must be >= {low}{why}")

    for dotted in ("training.steps", "training.seq_len", "training.local_batch_size", "metrics.log_freq",
                   "checkpoint.interval", "validation.interval", "validation.steps", "profiling.profile_freq",
                   "profiling.profile_active", "checkpoint.io_threads", "training.signal_check_freq",
                   "comm.init_timeout_seconds", "comm.train_timeout_seconds", "fault_tolerance.max_failed_commits"):
        at_least(dotted, 1)
    for dotted in ("training.gc_freq", "training.max_consecutive_bad_steps", "training.max_rollbacks",
                   "training.loss_spike_zscore", "checkpoint.keep_latest_k", "data.num_workers",
                   "lr_scheduler.warmup_steps", "optimizer.weight_decay", "training.loss_chunk_tokens",
                   "profiling.profile_warmup", "comm.trace_buf_size", "comm.heartbeat_interval_seconds"):
        at_least(dotted, 0)
    at_least("checkpoint.load_step", -1, " (-1 = newest complete step)")
    if cfg.training.max_rollbacks > 0 and not cfg.checkpoint.enable:
        errors.append("training.max_rollbacks > 0 rolls back to the newest checkpoint, but checkpoint.enable is "
                      "false: enable checkpoints or set training.max_rollbacks=0")
    if not cfg.comm.heartbeat_stall_seconds > 0:
        errors.append(f"comm.heartbeat_stall_seconds={cfg.comm.heartbeat_stall_seconds} must be > 0")
    if cfg.model.vocab_size != -1:
        at_least("model.vocab_size", 1, " (or -1 to take it from the tokenizer)")
    if cfg.model.n_layers != -1:
        at_least("model.n_layers", 1, " (or -1 for the flavor's)")
    at_least("model.vocab_pad_multiple", 1, " (1 = no padding)")

    for dotted in ("lr_scheduler.decay_ratio", "lr_scheduler.min_lr_factor"):
        value = _get(cfg, dotted)
        if not 0.0 <= value <= 1.0:
            errors.append(f"{dotted}={value} must be in [0, 1]")
    if not opt.lr > 0:
        errors.append(f"optimizer.lr={opt.lr} must be > 0")
    if not opt.eps > 0:
        errors.append(f"optimizer.eps={opt.eps} must be > 0")
    if len(opt.betas) != 2 or not all(0.0 <= b < 1.0 for b in opt.betas):
        errors.append(f"optimizer.betas={opt.betas} must be two numbers in [0, 1), e.g. [0.9, 0.95]")
    if not 0.0 <= opt.muon_momentum < 1.0:
        errors.append(f"optimizer.muon_momentum={opt.muon_momentum} must be in [0, 1), e.g. 0.95")
    if not 1 <= opt.muon_ns_steps < 100:
        errors.append(f"optimizer.muon_ns_steps={opt.muon_ns_steps} must be in [1, 99] (5 as the reference)")


def _check_features(cfg: JobConfig, errors: list[str]) -> None:
    f8, par, ft = cfg.float8, cfg.parallelism, cfg.fault_tolerance
    errors.extend(float8_config_problems(f8))
    check_float8_experts(cfg, errors)  # float8.moe_experts: the device; the model's experts in _check_model
    prof = cfg.profiling
    if prof.enable_profiling and prof.profile_warmup + prof.profile_active > prof.profile_freq:
        errors.append(f"profiling.profile_warmup + profile_active = {prof.profile_warmup} + {prof.profile_active} "
                      f"must be <= profiling.profile_freq={prof.profile_freq} (each trace ends at a multiple of it)")
    # The chunked loss fuses the LM head with the loss on one rank: TP's loss_parallel and PP's last-stage loss
    # already avoid or own the full logits there.
    if cfg.training.loss_chunk_tokens > 0 and (par.tp > 1 or par.pp > 1):
        errors.append(f"training.loss_chunk_tokens={cfg.training.loss_chunk_tokens} is not supported with "
                      f"parallelism.tp>1 or pp>1 (tp={par.tp}, pp={par.pp}); set training.loss_chunk_tokens=0")
    seq_len = cfg.training.seq_len
    # Load-balanced context parallel splits each sequence into 2*cp chunks.
    if par.cp > 1 and seq_len % (2 * par.cp):
        errors.append(f"training.seq_len={seq_len} must be divisible by 2*parallelism.cp = {2 * par.cp} "
                      f"(context parallel splits each sequence into 2*cp chunks)")
    # Sequence parallel (part of TP) shards the sequence dimension of norms and dropout over the TP ranks (each CP
    # rank's share of it under CP).
    elif par.tp > 1 and par.enable_sequence_parallel and (seq_len // par.cp) % par.tp:
        share = (f"training.seq_len={seq_len}" if par.cp == 1
                 else f"training.seq_len / parallelism.cp = {seq_len // par.cp}")
        errors.append(f"{share} must be divisible by "
                      f"parallelism.tp={par.tp} (sequence parallel shards the sequence over the TP ranks), or set "
                      f"parallelism.enable_sequence_parallel=false")
    if cfg.model.mask_kernel == "flex" and cfg.training.device == "cpu":
        errors.append("model.mask_kernel=\"flex\" cannot train on training.device=\"cpu\" (torch has no FlexAttention "
                      "backward on the CPU); use mask_kernel=\"auto\" or \"sdpa\"")
    if cfg.model.mixer_kernel == "fla" and cfg.training.device == "cpu":
        errors.append("model.mixer_kernel=\"fla\" cannot train on training.device=\"cpu\" (flash-linear-attention's "
                      "kernels are Triton, GPU only); use mixer_kernel=\"auto\" or \"torch\"")
    elif cfg.model.mixer_kernel == "fla" and importlib.util.find_spec("fla") is None:
        errors.append("model.mixer_kernel=\"fla\" needs flash-linear-attention's kernels: pip install "
                      "'titanlike[fla]' (fla-core), or use mixer_kernel=\"auto\"")
    ac = cfg.activation_checkpoint
    if ac.mode == "memory_budget" and not (cfg.compile.enable and "model" in cfg.compile.components):
        errors.append("activation_checkpoint.mode=\"memory_budget\" needs compile.enable=true with \"model\" in "
                      "compile.components (the budget steers torch.compile's partitioner); enable compile or use "
                      "mode=\"selective\"")
    if not 0.0 <= ac.memory_budget <= 1.0:
        errors.append(f"activation_checkpoint.memory_budget={ac.memory_budget} must be within [0, 1] (the fraction of "
                      f"a block's no-AC activation memory to keep)")
    # Async TP is an inductor pass over the compiled blocks: without compiling them it would silently do nothing.
    if par.tp > 1 and par.enable_async_tp and not (cfg.compile.enable and "model" in cfg.compile.components):
        errors.append("parallelism.enable_async_tp needs compile.enable=true with \"model\" in compile.components "
                      "(the collective/matmul fusion is a torch.compile pass); enable compile or turn async TP off")
    if ft.enable:
        if ft.group_size < 1:
            errors.append(f"fault_tolerance.group_size={ft.group_size} must be >= 1 when fault_tolerance.enable")
        elif not 0 <= ft.replica_id < ft.group_size:
            errors.append(f"fault_tolerance.replica_id={ft.replica_id} must be in [0, group_size={ft.group_size})")
        if not 1 <= ft.min_replica_size <= max(ft.group_size, 1):
            errors.append(f"fault_tolerance.min_replica_size={ft.min_replica_size} must be in "
                          f"[1, group_size={ft.group_size}]")
        # The replica groups ARE the replicate dimension: each group is its own job (FSDP/TP inside it).
        if par.dp_replicate != 1:
            errors.append(f"parallelism.dp_replicate={par.dp_replicate} must be 1 with fault_tolerance.enable: the "
                          f"torchft replica groups (fault_tolerance.group_size) are the replicate dimension")
        if par.pp > 1:
            errors.append(f"fault_tolerance.enable with parallelism.pp={par.pp} is not supported yet; use pp=1")
        gbs, unit = cfg.training.global_batch_size, cfg.training.local_batch_size * max(ft.group_size, 1)
        if gbs != -1 and gbs % unit:
            errors.append(f"training.global_batch_size={gbs} must be a multiple of local_batch_size*"
                          f"fault_tolerance.group_size = {unit} (times the data-parallel degree inside a group)")


def check_mixed_precision(t: Training, ft: bool, world_size: int | None, errors: list[str]) -> None:
    """training.mixed_precision_impl="master_weights" (titanlike/optim/master_weights.py): one device, bf16 or fp16
    weights; fp16 loss scaling is not wired into torchft's replica groups (`ft`: fault_tolerance.enable)."""
    if t.mixed_precision_param == "float16" and ft:
        errors.append("training.mixed_precision_param='float16' (loss scaling) is not supported with "
                      "fault_tolerance.enable yet; use 'bfloat16'")
    if t.mixed_precision_impl != "master_weights":
        return
    if (world_size or 1) > 1 or ft:
        errors.append(f"training.mixed_precision_impl='master_weights' is for runs on one device (this one has "
                      f"{world_size} processes{' and torchft' if ft else ''}); FSDP casts sharded weights itself: "
                      f"use mixed_precision_impl='auto'")
    if t.mixed_precision_param == "float32":
        errors.append("training.mixed_precision_impl='master_weights' keeps bf16 or fp16 weights, but "
                      "training.mixed_precision_param='float32'; set it to 'bfloat16' or 'float16', or use "
                      "mixed_precision_impl='auto'")


def check_loss_scaling(cfg: JobConfig, errors: list[str]) -> None:
    """[loss_scaling] (fp16; Megatron's --loss-scale flags): checked whatever the precision, so a config that turns
    fp16 on later does not start from a broken setting."""
    ls = cfg.loss_scaling
    if not (ls.static_scale >= 0 and math.isfinite(ls.static_scale)):
        errors.append(f"loss_scaling.static_scale={ls.static_scale} must be >= 0 (0 = dynamic loss scaling, > 0 = "
                      f"that fixed scale)")
    for key in ("initial_scale", "min_scale"):
        value = getattr(ls, key)
        if not (value > 0 and math.isfinite(value)):
            errors.append(f"loss_scaling.{key}={value} must be a finite number > 0 (e.g. initial_scale = 65536.0, "
                          f"min_scale = 1.0)")
    if 0 < ls.initial_scale < ls.min_scale:  # only between two valid scales: one mistake, one line
        errors.append(f"loss_scaling.min_scale={ls.min_scale} must be <= loss_scaling.initial_scale="
                      f"{ls.initial_scale} (the dynamic scale starts at initial_scale and never drops below "
                      f"min_scale); lower min_scale or raise initial_scale")
    for key, why in (("window", "steps without overflow before the scale doubles"),
                     ("hysteresis", "overflowing steps tolerated before the scale halves")):
        value = getattr(ls, key)
        if value < 1:
            errors.append(f"loss_scaling.{key}={value} must be >= 1 ({why})")


def _check_global_batch(cfg: JobConfig, dp_shard: int | None, errors: list[str]) -> None:
    tr, par = cfg.training, cfg.parallelism
    gbs, lbs = tr.global_batch_size, tr.local_batch_size
    if gbs == -1 or lbs < 1:
        return
    if dp_shard is None or par.dp_replicate < 1:  # dp degree unknown until the world size is: check what we can
        if gbs < 1 or gbs % lbs:
            errors.append(f"training.global_batch_size={gbs} must be -1 or a multiple of "
                          f"training.local_batch_size={lbs} (times the data-parallel degree)")
        return
    dp = par.dp_replicate * dp_shard
    unit = lbs * dp
    if gbs < 1 or gbs % unit:
        errors.append(
            f"training.global_batch_size={gbs} must be -1 or a multiple of local_batch_size*dp_degree = "
            f"{lbs}*{dp} = {unit} (dp_degree = dp_replicate*dp_shard = {par.dp_replicate}*{dp_shard}); "
            f"valid values: -1, {unit}, {2 * unit}, {3 * unit}, ...")


def advise(cfg: JobConfig) -> list[str]:
    """Settings that work but may not do what was meant: returns one warning each. Clamps the warmup of a run
    shorter than it (a smoke run of a real config), which would otherwise never reach the peak LR."""
    notes = []
    tr, lrs = cfg.training, cfg.lr_scheduler
    if lrs.warmup_steps > tr.steps:
        notes.append(f"lr_scheduler.warmup_steps={lrs.warmup_steps} exceeds training.steps={tr.steps}: warming up "
                     f"over all {tr.steps} steps instead")
        lrs.warmup_steps = tr.steps
    notes += lora_advice(cfg)
    import models

    spec = models.MODELS.get(cfg.model.name)
    args = spec.flavors.get(cfg.model.flavor) if spec is not None else None
    if args is not None and tr.seq_len > args.max_seq_len:
        notes.append(f"training.seq_len={tr.seq_len} is longer than the {cfg.model.name} {cfg.model.flavor} flavor's "
                     f"context ({args.max_seq_len}): RoPE runs on all {tr.seq_len} positions with the flavor's own "
                     f"frequencies (no extra RoPE scaling); fine from scratch, but weights trained at "
                     f"{args.max_seq_len} will see positions they never saw")
    return notes + advise_data(cfg)


def validate(cfg: JobConfig, world_size: int | None = None) -> None:
    """Raise ConfigError listing every broken rule. With world_size, also check that the degrees fill it."""
    errors: list[str] = []
    dp_shard = _check_parallelism(cfg.parallelism, world_size, errors)
    _check_choices(cfg, errors)
    _check_numbers(cfg, errors)
    _check_features(cfg, errors)
    _check_global_batch(cfg, dp_shard, errors)
    check_mixed_precision(cfg.training, cfg.fault_tolerance.enable, world_size, errors)
    check_loss_scaling(cfg, errors)
    check_data(cfg, errors)
    check_dpo(cfg, errors)  # [dpo], and what preference data (DPO) does not run with yet
    if cfg.checkpoint.create_seed_checkpoint and world_size is not None and world_size > 1:
        errors.append(f"checkpoint.create_seed_checkpoint runs on one process (world size is {world_size}): "
                      f"run `python scripts/train.py ... --checkpoint.create_seed_checkpoint` without torchrun")
    check_pipeline(cfg, errors)
    check_cp(cfg.parallelism, errors)  # parallelism.cp_method's name
    check_eval(cfg, errors)  # [eval]: task names (lm_eval's index), include_path, perplexity sets
    check_lora(cfg, errors)  # [lora]: its values; the targets against the model in _check_model
    dump = cfg.job.dump_folder
    if os.path.exists(dump) and not os.path.isdir(dump):
        errors.append(f"job.dump_folder={dump!r} is a file, not a folder; choose another job.dump_folder")
    cache = cfg.compile.cache_dir  # (titanlike/train/compile_cache.py)
    if cache and cache != "auto" and os.path.exists(cache) and not os.path.isdir(cache):
        errors.append(f"compile.cache_dir={cache!r} is a file, not a folder; give a folder (shared storage for "
                      f"requeued jobs), \"auto\" (the run folder's compile_cache) or \"\" (torch's defaults)")
    if not errors:
        _check_model(cfg, errors)
    if errors:
        if len(errors) == 1:
            raise ConfigError(errors[0])
        raise ConfigError(f"{len(errors)} config errors:\n" + "\n".join(f"  - {e}" for e in errors))


def _check_model(cfg: JobConfig, errors: list[str]) -> None:
    """The model's own rules on its flavor's shapes (heads by tp, experts by ep, ...), at load time: before any
    process group exists. The trainer checks again with the run's exact args (validate_model)."""
    import dataclasses

    import models

    if cfg.model.name not in models.MODELS:
        errors.append(f"model.name={cfg.model.name!r} is not a known model; choose one of {sorted(models.MODELS)}")
        return
    spec = models.MODELS[cfg.model.name]
    if cfg.model.flavor not in spec.flavors:
        errors.append(f"model.flavor={cfg.model.flavor!r} is not a {spec.name} flavor; choose one of "
                      f"{sorted(spec.flavors)}")
        return
    try:
        args = spec.flavor_args(cfg.model.flavor, cfg.model.args)
    except ValueError as e:
        errors.append(str(e))
        return
    if cfg.model.n_layers > 0:
        args = dataclasses.replace(args, n_layers=cfg.model.n_layers)
    # the run's seq_len, as the trainer sets it (checks such as MTP's depth against the sequence read it)
    args = dataclasses.replace(args, max_seq_len=cfg.training.seq_len)
    errors.extend(spec.check(args, cfg.parallelism, cfg.model.flavor))
    if cfg.model.mixer_kernel == "fla" and spec.mixer_sizes is not None:  # "auto" keeps such mixers on PyTorch
        from models.common.fla_kernels import MAX_HEAD_DIM

        errors.extend(f"model.mixer_kernel=\"fla\": {key}={size} is above {MAX_HEAD_DIM}, the largest head size "
                      f"fla's kernels take; use mixer_kernel=\"auto\" or \"torch\" (the PyTorch scans)"
                      for key, size in spec.mixer_sizes(args).items() if size > MAX_HEAD_DIM)
    from models.batch import build_objective

    # the objective as the trainer builds it (titanlike/train/construct.py): max_seq_len is the run's seq_len
    objective = build_objective(spec.objective, dataclasses.replace(args, max_seq_len=cfg.training.seq_len))
    problem = getattr(objective, "data_problem", lambda data: None)(cfg.data)
    if problem:  # what the family's objective needs of the data (BERT: the binary head's label)
        errors.append(problem)
    if not errors:  # (the family's TP rule on heads first)
        check_cp_model(spec, args, cfg.parallelism, errors)
    check_lora_model(cfg, spec, args, errors)  # [lora] targets and rank against the flavor's model, on meta
    check_float8_experts_model(cfg, spec, args, errors)  # float8.moe_experts: routed experts, widths by 16


def validate_model(spec, model_args: Any, par: Parallelism, flavor: str) -> None:
    """Rules that need the model's shapes: the family's own checks (ModelSpec.check: heads by TP, ...) and the
    pipeline's stages against its layers. `flavor`: model.flavor, for the messages."""
    errors = list(spec.check(model_args, par, flavor))
    if not errors:
        check_cp_model(spec, model_args, par, errors)  # alltoall: cp divides a TP rank's heads
    check_pipeline_model(model_args.n_layers, par, flavor, errors)  # stages (pp x stages per rank) <= n_layers
    if errors:
        raise ConfigError("\n".join(errors))
