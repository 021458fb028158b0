"""The compute half of a training step, one copy: Trainer.train_step runs it and the memory estimate
(titanlike/planner/step.py) traces it, so whatever changes here (a context, the loss, the backward) is in both.

    for each micro-batch:   with attention kernels, loss parallel:          (backward kernels and handlers follow
                                with autocast: loss = forward_loss(batch)    the forward's: both inside)
                                (loss * scale).backward()
    then Updater.clip and the optimizer step (titanlike/train/update.py).

What only the trainer does around it (token counts and the loss scale, the pipeline schedule, the non-finite guard,
torchft's commit, float8 and MoE hooks) stays in Trainer.train_step; what only the estimate does (fake hidden states
for a later pipeline stage, the compiled loss's memory) comes in through `x`, `last` and `loss_fn`.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch.distributed.tensor.parallel import loss_parallel

from models.batch import Batch
from models.common.backends import sdpa_context
from parallelize.compile import compile_loss
from titanlike.train.loss import loss_targets, objective_loss, plain_loss


class StepCompute:
    """Forward, loss and backward of one micro-batch with the run's contexts. `precision`: the Updater's mode (who
    casts the weights); `loss_fn(output, labels, **batch.extras) -> summed loss`: default the objective's loss, compiled
    when compile.components has "loss" (DPO passes its own, which also reads the reference log-probs the Batch carries
    in extras); `loss_head`: the chunked-loss LM head (its forward returns the loss)."""

    @classmethod
    def of(cls, cfg, dims, device: torch.device, precision: str, objective, loss_head,
           loss_fn: Callable | None = None) -> StepCompute:
        """From a JobConfig: the four sections it reads."""
        return cls(cfg.training, cfg.model, cfg.parallelism, cfg.compile, dims, device, precision, objective,
                   loss_head, loss_fn)

    def __init__(self, training, model_cfg, par, compile_cfg, dims, device: torch.device, precision: str, objective,
                 loss_head, loss_fn: Callable | None = None):
        self.loss_fn = loss_fn if loss_fn is not None else compile_loss(objective_loss(objective), compile_cfg)
        self.loss_head = loss_head
        self.device_type = device.type
        # autocast only where nothing else casts the weights (titanlike/optim/master_weights.py)
        self.amp_dtype = getattr(torch, training.mixed_precision_param) if precision == "autocast" else None
        self.attention_kernels = sdpa_context(model_cfg.attn_backend, device)  # per pass (model.attn_backend)
        # TP's output layer leaves the logits vocabulary-sharded: cross-entropy and its backward run under
        # loss_parallel(), which never gathers [tokens, vocab] (the model's TP plan in parallelize/<model>.py).
        self.loss_parallel = dims.tp_enabled and par.enable_loss_parallel

    def amp(self):
        """The forward's autocast (a new context each time), or nothing."""
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.amp_dtype)

    def loss_context(self, last: bool = True):
        """Where the loss and its backward run: loss_parallel() under TP's sharded logits (on the stage with them)."""
        return loss_parallel() if self.loss_parallel and last else contextlib.nullcontext()

    def forward_loss(self, model: torch.nn.Module, batch: Batch, x: torch.Tensor | None = None,
                     last: bool = True) -> torch.Tensor:
        """Summed loss of one micro-batch; with the chunked loss the model's LM head returns it directly. `x`: the
        input in place of the batch's primary one (a later pipeline stage's hidden states); last=False: a stage
        without the output layer, whose output is returned as it is."""
        args = batch.args() if x is None else (x,)
        if not last:
            return model(*args, **batch.kwargs())
        if self.loss_head is None:
            return plain_loss(self.loss_fn(model(*args, **batch.kwargs()), batch.labels, **batch.extras))
        with loss_targets(self.loss_head, batch.labels):
            return model(*args, **batch.kwargs())

    def forward_backward(self, model: torch.nn.Module, batch: Batch, scale, x: torch.Tensor | None = None,
                         last: bool = True, after_forward: Callable[[], None] | None = None) -> torch.Tensor:
        """forward_loss, then the backward of loss * scale (last=False: of the output with a gradient of ones, as the
        estimate runs a stage without the schedule); the loss (or output), detached. after_forward() runs between
        the two (the estimate measures the activations there)."""
        with self.attention_kernels(), self.loss_context(last):
            with self.amp():
                out = self.forward_loss(model, batch, x, last)
            if after_forward is not None:
                after_forward()
            if last:
                (out * scale).backward()
            else:
                out.backward(torch.ones_like(out))
        return out.detach()


__all__ = ["StepCompute"]
