"""The pipeline-parallel variant of the training step (used by Trainer when parallelism.pp > 1).

PipelineRunner owns the schedule built by parallelize/pp.py and gives the trainer the same four things the
plain step has: a step over the micro-batches (the schedule's), the loss sum (last stage only), a gradient norm
clipped across all stages, and a forward without gradients (validation, DPO's reference log-probs).

Loss convention (as Trainer.train_step): the schedule calls the loss once per micro-batch on the last stage;
it returns sum-of-token-CE * (FSDP divide factor / global token count), the schedule gets scale_grads=False, so
the accumulated gradients are exactly those of the global token-mean loss. The logged CE sum is the schedule's
losses divided by that scale again (device tensors: no host sync); `reduce_over_pp` brings it from the last
stage to every rank, on log steps only.

Tied parameters (the model's `tied_parameters`, e.g. an output projection tied to the embedding) split over two
stages: each stage holds its copy; after the schedule's backward the two gradients are summed over the ranks holding
them, and the grad norm counts the copy's stage out (parallelize/tied.py, Megatron's embedding group). Multi-token
prediction is such a tie: its modules run on the last stage, which holds a copy of the token embedding
(parallelize/pp.py:model_layout), and read the input ids and labels as keyword inputs, which reach every stage.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from models.batch import Batch
from models.common.moe import MoE
from models.common.mtp import MTP
from parallelize.pp import Pipeline, build_pipeline
from parallelize.sections import PlanSections
from parallelize.tied import TiedParameters, tied_pairs
from titanlike.optim.adamw import clip_with_norm_, grad_norm
from titanlike.train.pipeline_targets import pack_targets, unpack_targets


class PipelineRunner:
    def __init__(self, model: nn.Module, spec, args, dims, sections: PlanSections, device: torch.device,
                 stage_plan: Callable, loss_fn: Callable):
        """Split meta `model` (ModelSpec `spec`, built from `args`) and build the schedule (see
        parallelize.pp.build_pipeline; `sections` is what the plan and the split read). `loss_fn(logits, labels,
        **extras)` returns the summed loss of one micro-batch (the objective's loss: output against Batch.labels,
        reading Batch.extras when it has any)."""
        self.loss_fn = loss_fn
        self.device = device
        self.pp_group = dims.get_mesh("pp").get_group()
        self._scale = torch.ones((), device=device)  # per step: FSDP divide factor / global token count
        self._target_layout = None  # per schedule step: where the extras sit in the packed target
        self._metadata_pass = False  # True while torch's one-time shape inference calls the loss
        self.pipeline: Pipeline = build_pipeline(model, spec, args, dims, sections, device, self._schedule_loss,
                                                 stage_plan)
        self.schedule = self.pipeline.schedule
        self.model_parts: list[nn.Module] = self.pipeline.model_parts
        self.has_first = self.pipeline.has_first_stage
        self.has_last = self.pipeline.has_last_stage
        if hasattr(PipelineStage, "_forward_metadata_inference"):
            for part in self.model_parts:
                _forget_metadata_pass(part)
        for stage in self.pipeline.stages:
            self._mark_metadata_pass(stage)
        # Ties split over stages: the copies' gradients summed with their sources' after each backward.
        pairs = tied_pairs(model, self.pipeline.layout)
        self.tied = TiedParameters(pairs, {s.stage_index: s.submod for s in self.pipeline.stages},
                                   self.pipeline.owners, dims.world_mesh)

    def _mark_metadata_pass(self, stage: PipelineStage) -> None:
        """Torch's stages (those with _backward_metadata_inference) call the loss once at the first schedule step on
        activations made from empty tensors, to learn the gradients' shapes. A loss that records something (DPO's
        reward statistics) must not see that call: flag it, and _schedule_loss answers it with a zero loss of the
        output (the shapes are all the inference reads)."""
        infer = getattr(stage, "_backward_metadata_inference", None)
        if infer is None or not stage.is_last:
            return

        def flagged(*args, **kwargs):
            self._metadata_pass = True
            try:
                return infer(*args, **kwargs)
            finally:
                self._metadata_pass = False

        stage._backward_metadata_inference = flagged

    def _schedule_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self._metadata_pass:
            loss = sum(o.sum() for o in (output if isinstance(output, tuple) else (output,))) * 0
        else:
            labels, extras = unpack_targets(target, self._target_layout)
            loss = self.loss_fn(output, labels, **extras)
        if isinstance(loss, DTensor):  # loss parallel (TP) returns a replicated DTensor; to_local-like, differentiable
            loss = loss.full_tensor()
        return loss * self._scale

    def _schedule_step(self, batch: Batch) -> torch.Tensor:
        """One schedule step (forward + backward of all micro-batches); this rank's CE sum (zero off the last
        stage)."""
        # The schedule's own per-micro-batch losses: torch 2.13 also calls the loss fn during its one-time
        # metadata inference, so recording the calls would count one too many.
        losses: list[torch.Tensor] = []
        # Only the first stage takes the primary input (other stages receive activations; torch refuses args there
        # during shape inference), only the last one the labels; the other named inputs go to every stage as keyword
        # arguments. return_outputs=False: the last stage would otherwise keep and concatenate every micro-batch's
        # logits.
        target, self._target_layout = pack_targets(batch.labels, batch.extras) if self.has_last else (None, None)
        self.schedule.step(*(batch.args() if self.has_first else ()), target=target, losses=losses,
                           return_outputs=False, **batch.kwargs())
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.detach() for loss in losses]).sum() / self._scale

    def step(self, batches: list[Batch], scale: torch.Tensor) -> torch.Tensor:
        """Forward + backward of every Batch through the schedule, gradients accumulated (one schedule step per
        batch; the schedule splits each, keyword inputs too, into pp_microbatches and gives every stage its share of
        the keyword inputs)."""
        self._scale = scale
        loss_sum = torch.zeros((), device=self.device)
        for batch in batches:
            loss_sum = loss_sum + self._schedule_step(batch)
        if self.tied:
            self.tied.sync_grads()  # after every micro-batch's backward (gradients are linear), before clipping
        return loss_sum

    def eval_loss(self, batch: Batch) -> torch.Tensor:
        """Summed loss of one Batch, forward only (zero off the last stage)."""
        total = torch.zeros((), device=self.device)
        for loss in self.forward_only(batch, lambda out, mb: self.loss_fn(out, mb.labels, **mb.extras)):
            total += loss.full_tensor() if isinstance(loss, DTensor) else loss
        return total

    @torch.no_grad()
    def forward_only(self, batch: Batch, head: Callable, stages: dict[int, nn.Module] | None = None) -> list:
        """head(output, micro-batch) of each micro-batch of `batch` (at most pp_microbatches of them, cut along the
        rows), forward only, on the last stage; an empty list on the other ranks. `stages`: the modules to run, by
        stage index (default this rank's stages; DPO's frozen reference copy is split as the policy is).

        Not schedule.eval(): torch runs the training action list there, and the V-shaped schedules then fail
        on their backward actions (torch 2.13), while switching the schedule between eval and train re-runs
        its metadata inference. Forward-only passes are rare, so a plain sequential pass suffices: micro-batch by
        micro-batch, each rank runs its stages in stage order, receiving and sending activations with
        blocking point-to-point calls (a header with shape and dtype first, so any layout goes through)."""
        p = self.pipeline
        by_index = stages if stages is not None else {s.stage_index: s.submod for s in p.stages}
        me, last = dist.get_rank(self.pp_group), len(p.layout) - 1
        results = []
        for mb in batch.split(min(p.n_microbatches, batch.labels.shape[0])):
            (x,), kw = mb.args(), mb.kwargs()
            for sid, owner in enumerate(p.owners):
                if owner != me:
                    continue
                if sid > 0 and p.owners[sid - 1] != me:
                    x = self._recv(p.owners[sid - 1])
                x = by_index[sid](x, **kw)
                if sid == last:
                    results.append(head(x, mb))
                elif p.owners[sid + 1] != me:
                    self._send(x, p.owners[sid + 1])
        return results

    _DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    _HEADER = 8  # ndim, up to 6 sizes, dtype index

    def _send(self, x: torch.Tensor, peer: int) -> None:
        if isinstance(x, DTensor):
            x = x.to_local()
        x = x.contiguous()
        header = torch.zeros(self._HEADER, dtype=torch.int64, device=self.device)
        header[0], header[1:1 + x.ndim], header[-1] = x.ndim, torch.tensor(x.shape), self._DTYPES.index(x.dtype)
        dst = dist.get_global_rank(self.pp_group, peer)
        dist.send(header, dst=dst, group=self.pp_group)
        dist.send(x, dst=dst, group=self.pp_group)

    def _recv(self, peer: int) -> torch.Tensor:
        src = dist.get_global_rank(self.pp_group, peer)
        header = torch.empty(self._HEADER, dtype=torch.int64, device=self.device)
        dist.recv(header, src=src, group=self.pp_group)
        ndim, *rest = header.tolist()
        x = torch.empty(rest[:ndim], dtype=self._DTYPES[rest[-1]], device=self.device)
        dist.recv(x, src=src, group=self.pp_group)
        return x

    def reduce_over_pp(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the pipeline ranks (in place): turns the last stage's loss into every rank's."""
        dist.all_reduce(x, group=self.pp_group)
        return x

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, fused_into=None, loss_scale=None) -> torch.Tensor:
        """Clip by the L2 norm over all stages and shards; returns it (identical on every rank, no host sync).

        Each rank holds different parameters: its local norm (full_tensor() reduces DTensor shards over the
        FSDP/TP mesh) is squared, summed over the pp group, and square-rooted. fused_into: see
        titanlike.optim.clip_with_norm_ (which also divides by an fp16 loss_scale and returns the true norm).

        A tied parameter split over two stages counts once: its copy (equal gradient, after sync_grads) is left out
        of the norm, and clipped by the same factor."""
        params = [p for part in self.model_parts for p in part.parameters() if p.grad is not None]
        excluded = self.tied.norm_excluded()
        # titanlike.optim.grad_norm: DTensor grads on several meshes/placements (FSDP x TP) reduce group by group
        sq = grad_norm([p.grad for p in params if id(p) not in excluded]).to(self.device).float() ** 2
        dist.all_reduce(sq, group=self.pp_group)
        return clip_with_norm_(params, max_norm, sq.sqrt(), fused_into, loss_scale)


def _forget_metadata_pass(part: nn.Module) -> None:
    """Torch's pipeline stages (those with _forward_metadata_inference) run one extra forward of each stage module
    at the first schedule step, to learn the shapes they send, on the real first batch or on empty tensors. MoE
    layers count their routed tokens in every training forward (the expert-bias balancing reads the counts), so
    that pass would add tokens that were never trained on: zero the counters right after it. The MTP modules' logged
    losses (models/common/mtp.py) likewise: that pass's are dropped."""
    layers = [m for m in part.modules() if isinstance(m, MoE)]
    mtps = [m for m in part.modules() if isinstance(m, MTP)]
    if not layers and not mtps:
        return

    def after_first_forward(module, inputs, output):
        for m in layers:
            m.tokens_per_expert.zero_()
            m.dropped_assignments.zero_()
        for m in mtps:
            m.take_losses()
        handle.remove()

    handle = part.register_forward_hook(after_first_forward)
