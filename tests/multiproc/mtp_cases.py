"""Multi-token prediction (models/common/mtp.py) under tensor and pipeline parallel against one process (gloo, fp32,
1e-5): the cases tp_worker.py and pp_worker.py run in their launches (no launch of their own).

Each case trains STEPS AdamW steps of a tiny model with two MTP depths (weight 0.3, so an error in their gradient
shows) and compares, every step, the main loss, each depth's MTP loss as the trainer logs it
(titanlike.train.mtp.MTPBookkeeping: under PP the last stage's, read on every pp rank), the clipped grad norm and
every parameter's gradient (before clipping), and every parameter after the steps (within PARAM_TOL: AdamW's first
updates are +-lr wherever a gradient is near zero, so a 1e-9 difference there moves a weight by up to 2 * lr).
- TP (+ sequence parallel + loss parallel): the family's default plan, the MTP entries of parallelize/mtp.py; the
  forward and backward inside loss_parallel(), as the trainer runs them.
- PP: titanlike.train.pipeline.PipelineRunner (the trainer's PP path): MTP on the last stage with a tied copy of the
  token embedding (parallelize/tied.py sums the two stages' gradients); the one-process reference runs the same
  micro-batches one after another, as MTP and the MoE's losses are per micro-batch.
DeepSeek-V3 (MLA, MoE blocks, its MTP blocks MoE too) runs its balance loss and expert-bias update on both sides
(titanlike.train.moe.MoEBookkeeping).
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

import models
from models.batch import StepContext
from models.common.mtp import mtp_objective
from par_helpers import SEQ, VOCAB, global_batch, tiny_args
from parallelize import PlanSections, get_plan
from titanlike.config.sections import JobConfig
from titanlike.distributed.parallel_dims import ParallelDims
from titanlike.optim.adamw import clip_grad_norm_
from titanlike.optim.container import OptimizersContainer
from titanlike.train.moe import MoEBookkeeping
from titanlike.train.mtp import MTPBookkeeping
from titanlike.train.pipeline import PipelineRunner

TOL = 1e-5
PARAM_TOL = 1e-4
STEPS = 3
LOCAL_BATCH = 4  # rows per data-parallel rank per step
MAX_NORM = 0.5


def mtp_args(family: str, n_layers: int):
    if family == "llama3":
        args = dataclasses.replace(tiny_args(), n_layers=n_layers)
    else:  # deepseek_v3's debug model: a dense block, then MoE blocks (and MoE MTP blocks)
        args = dataclasses.replace(models.get_spec(family).flavor_args("debugmodel"), vocab_size=VOCAB,
                                   max_seq_len=SEQ, n_layers=n_layers)
    return dataclasses.replace(args, mtp_num_layers=2, mtp_loss_weight=0.3)


def ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def mtp_case(name: str, family: str, dims_kw: dict, world: int, schedule: str | None = None, sp: bool = True,
             lp: bool = True) -> str:
    """One case; returns its "CHECK" detail (asserts on failure). schedule: PP 2 with that schedule, else no PP."""
    pp = 2 if schedule else 1
    n_layers = 4 if schedule and schedule != "1F1B" else 2  # a block per stage: two stages per rank but in 1F1B
    dims = ParallelDims(pp=pp, **dims_kw, world_size=world)
    dims.build_mesh("cpu")
    cfg = JobConfig()
    cfg.training.seq_len, cfg.training.local_batch_size = SEQ, LOCAL_BATCH
    cfg.parallelism.enable_sequence_parallel, cfg.parallelism.enable_loss_parallel = sp, lp
    cfg.parallelism.pp = pp
    if schedule:
        cfg.parallelism.pp_schedule, cfg.parallelism.pp_microbatches = schedule, 2 if schedule == "1F1B" else 4
    spec, args = models.get_spec(family), mtp_args(family, n_layers)
    objective = mtp_objective(args)

    torch.manual_seed(0)
    ref = spec.model_cls(args)
    ref.init_weights()
    with torch.device("meta"):
        meta = spec.model_cls(args)
    plan = get_plan(family, "default")
    runner = None
    if schedule:
        runner = PipelineRunner(meta, spec, args, dims, PlanSections.of(cfg), torch.device("cpu"), plan, ce_sum)
        parts, n_mb = runner.model_parts, runner.pipeline.n_microbatches
        assert runner.tied.pairs, f"{name}: no tied embedding between the first and the last stage"
    else:
        parts, n_mb = [plan(meta, dims, PlanSections.of(cfg))], 1
    ref_sd = ref.state_dict()
    for part in parts:
        part.to_empty(device="cpu")
        torch.manual_seed(123)  # a different init: the copy below must overwrite all of it
        part.init_weights(buffer_device="cpu")
        set_model_state_dict(part, {k: ref_sd[k] for k in part.state_dict()},
                             options=StateDictOptions(full_state_dict=True))
    dp, dp_rank = dims.dp_degree, dims.dp_rank()
    ref_mtp = MTPBookkeeping([ref], ParallelDims(world_size=1), dp * n_mb)
    ref_moe = MoEBookkeeping([ref], ParallelDims(world_size=1), dp * n_mb)
    book, moe = MTPBookkeeping(parts, dims, n_mb), MoEBookkeeping(parts, dims, n_mb)
    assert book, f"{name}: rank {dist.get_rank()} does not know the MTP depths"

    opt_kw = dict(lr=1e-3, weight_decay=0.1, foreach=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), **opt_kw)
    opts = [torch.optim.AdamW(p.parameters(), **opt_kw) for p in parts]
    opt = opts[0] if len(opts) == 1 else OptimizersContainer(opts)
    loss_ctx = loss_parallel if dims.tp_enabled and lp else contextlib.nullcontext
    loss_group = dims.get_mesh("dp_cp")
    worst = {"loss": 0.0, "mtp": 0.0, "grad": 0.0, "norm": 0.0}
    ref_params = dict(ref.named_parameters())
    for step in range(STEPS):
        inputs, labels = global_batch(step, dp * LOCAL_BATCH)
        n_tokens = labels.numel()
        ref_loss = torch.zeros(())
        for x, y in zip(inputs.chunk(dp * n_mb), labels.chunk(dp * n_mb)):  # the layout's micro-batches, in order
            b = objective(x, y, StepContext(step, 0))
            loss = ce_sum(ref(*b.args(), **b.kwargs()), y) / n_tokens
            loss.backward()
            ref_loss += loss.detach()
        ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_moe.after_step(log=False)
        want = ref_mtp.after_step(log=True)

        rows = slice(dp_rank * LOCAL_BATCH, (dp_rank + 1) * LOCAL_BATCH)
        b = objective(inputs[rows], labels[rows], StepContext(step, 0))
        scale = torch.tensor(float(dims.dp_cp_degree) / n_tokens)  # FSDP's mean back to the global token mean
        with loss_ctx():
            if runner is not None:
                loss = runner.reduce_over_pp(runner.step([b], scale))
            else:
                loss = _full(ce_sum(parts[0](*b.args(), **b.kwargs()), b.labels))
                (loss * scale).backward()
                loss = loss.detach()
        for part in parts:
            for n, p in part.named_parameters():
                if n in ref_grads:
                    d = (_full(p.grad) - ref_grads[n]).abs().max().item()
                    assert d <= TOL, f"{name}: the gradient of {n} differs from one process by {d}"
                    worst["grad"] = max(worst["grad"], d)
        norm = runner.clip_grad_norm_(MAX_NORM) if runner is not None else clip_grad_norm_(parts[0].parameters(),
                                                                                            MAX_NORM)
        opt.step()
        opt.zero_grad()
        moe.after_step(log=False)
        got = book.after_step(log=True)
        if loss_group is not None:
            dist.all_reduce(loss, group=loss_group.get_group())
        loss = loss / n_tokens
        assert set(got) == set(want) == {"mtp/loss_1", "mtp/loss_2"}, f"{name}: MTP metrics {got} vs {want}"
        for key, value in want.items():
            assert abs(got[key] - value) <= TOL, f"{name} step {step}: {key} {got[key]} vs one process {value}"
            worst["mtp"] = max(worst["mtp"], abs(got[key] - value))
        worst["loss"] = max(worst["loss"], abs(loss.item() - ref_loss.item()))
        worst["norm"] = max(worst["norm"], abs(norm.item() - ref_norm.item()))
        assert worst["loss"] <= TOL, f"{name} step {step}: loss {loss.item()} vs one process {ref_loss.item()}"
        assert worst["norm"] <= TOL, f"{name} step {step}: grad norm {norm.item()} vs one process {ref_norm.item()}"
    worst_p = 0.0
    for part in parts:
        for n, p in part.named_parameters():
            d = (_full(p.detach()) - ref_params[n].detach()).abs().max().item()
            assert d <= PARAM_TOL, f"{name}: parameter {n} differs from one process by {d}"
            worst_p = max(worst_p, d)
    dist.barrier()
    return (f"loss_diff={worst['loss']:.1e} mtp_diff={worst['mtp']:.1e} grad_diff={worst['grad']:.1e} "
            f"norm_diff={worst['norm']:.1e} param_diff={worst_p:.1e} mtp={[round(v, 4) for v in got.values()]}")
