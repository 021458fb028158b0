"""The Llama 3 parallelization plans. Order matters and is kept visible: (TP) -> AC -> compile -> FSDP.

CP (parallelize/cp.py) goes after TP and before AC. AC before compile so the checkpoint is traced into each block's graph; compile before FSDP so FSDP2's
hooks run outside the compiled blocks; FSDP last because it wraps whatever the block has become.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel, SequenceParallel,
)

from models.llama3 import SPEC
from parallelize.ac import apply_ac
from parallelize.compile import apply_compile
from parallelize.cp import maybe_cp
from parallelize.fsdp import maybe_fsdp
from parallelize.tp import (
    ReplicateParallel, SyncOutputColwiseParallel, SyncOutputRowwiseParallel, apply_tp, maybe_enable_async_tp,
)


def _refuse_unimplemented(dims, allow: tuple[str, ...] = ()) -> None:
    # Config validation refuses these first; checking here keeps a hand-built ParallelDims honest.
    for name, degree in (("tp", dims.tp), ("pp", dims.pp), ("cp", dims.cp), ("ep", dims.ep)):
        if name in allow:
            continue
        if degree > 1:
            raise ValueError(
                f"parallelism.{name}={degree}: this llama3 plan does not implement {name.upper()} (Llama 3 has no "
                f"experts to shard); set parallelism.{name}=1"
            )


def llama_tp_plan(*, sequence_parallel: bool = True, loss_parallel: bool = True) -> dict[str, ParallelStyle]:
    """Module path -> DTensor style, applied in this order (see parallelize/tp.py for the layouts it produces)."""
    seq = Shard(1) if sequence_parallel else Replicate()  # the residual stream between blocks
    plan: dict[str, ParallelStyle] = {
        # Vocabulary-sharded rows; token ids arrive replicated on every TP rank. (SyncOutput*: the output feeds
        # compiled code, see parallelize/tp.py.)
        "tok_embeddings": SyncOutputRowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "layers.*.attention_norm": SequenceParallel(),
        # (hidden, rope_cache): one all-gather feeds wq, wk and wv; the RoPE table stays a plain tensor.
        "layers.*.attention": PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None)),
        "layers.*.attention.wq": ColwiseParallel(),  # plain local heads out: SDPA runs on ordinary tensors
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=seq),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=seq),
        "norm": SequenceParallel(),
        # Loss parallel keeps the logits vocabulary-sharded (a DTensor, so loss_parallel() sees the sharding).
        "output": SyncOutputColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else
                                            Replicate(), use_local_output=not loss_parallel),
    }
    if not sequence_parallel:  # the norms then see the whole sequence on every rank: replicated parameters
        plan = {k: ReplicateParallel() if isinstance(v, SequenceParallel) else v for k, v in plan.items()}
    return plan


def _maybe_tp(model: nn.Module, dims, cfg) -> None:
    """Tensor (+ sequence, loss, async) parallel over the "tp" mesh axis with llama_tp_plan (parallelize/tp.py)."""
    if not dims.tp_enabled:
        return
    par = cfg.parallelism
    problems = SPEC.check(model.args, dims, cfg.model.flavor)  # config validation ran it too; a hand-built dims
    if problems:
        raise ValueError(problems[0])
    tp_mesh = dims.get_mesh("tp")
    plan = llama_tp_plan(sequence_parallel=par.enable_sequence_parallel, loss_parallel=par.enable_loss_parallel)
    apply_tp(model, tp_mesh, plan)
    maybe_enable_async_tp(tp_mesh, par.enable_async_tp,
                          compile_enabled=cfg.compile.enable and "model" in cfg.compile.components)


def parallelize_llama(model: nn.Module, dims, cfg) -> nn.Module:
    """Default plan: TP -> CP -> AC -> per-block compile -> FSDP2/HSDP. `cfg` is the JobConfig; returns the model."""
    # pp: parallelize/pp.py splits the model first and calls the plan on each stage (modules it lacks are None).
    _refuse_unimplemented(dims, allow=("tp", "pp", "cp"))
    _maybe_tp(model, dims, cfg)  # first: it changes the parameter placements that AC/compile/FSDP then see
    maybe_cp(model, dims)  # before AC and compile, which trace the attention kernel it installs
    apply_ac(model, cfg.activation_checkpoint)
    apply_compile(model, cfg.compile)
    maybe_fsdp(model, dims, cfg, SPEC.input_modules, SPEC.output_modules)
    return model


def parallelize_llama_fsdp_only(model: nn.Module, dims, cfg) -> nn.Module:
    """Alternative plan: FSDP2/HSDP (and CP where set) only; ignores the AC and compile sections (a baseline for
    debugging)."""
    if dims.tp_enabled:
        raise ValueError(f"model.plan='fsdp_only' applies FSDP only, but parallelism.tp={dims.tp}; use "
                         f"model.plan='default' (TP -> AC -> compile -> FSDP) or set parallelism.tp=1")
    _refuse_unimplemented(dims, allow=("pp", "cp"))  # pp: applied per stage, as in parallelize_llama
    maybe_cp(model, dims)
    maybe_fsdp(model, dims, cfg, SPEC.input_modules, SPEC.output_modules)
    return model


# Plan name (model.plan) -> plan; models/llama3's ModelSpec points here.
PLANS = {"default": parallelize_llama, "fsdp_only": parallelize_llama_fsdp_only}
