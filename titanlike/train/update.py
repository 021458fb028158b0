"""The update half of a training step: from the gradients backward left to the weights the next forward reads.

Who holds fp32 weights (titanlike/optim/master_weights.py: mixed_precision_mode), the optimizer and LR schedule, the
clip (DTensor-aware, folded into fused kernels), the non-finite guard (titanlike/resilience/nonfinite.py) and fp16
loss scaling (titanlike/optim/loss_scale.py) decide together whether and how a step updates, so they live here.
Nothing here waits for the GPU except where a host-side optimizer must be told to skip (CPU).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from titanlike.config.sections import (Checkpoint, Compile, FaultTolerance, JobConfig, LossScaling, LRScheduler,
                                       Optimizer, Training)

from titanlike.optim.adamw import build_optimizer, clip_grad_norm_, fused_clip_optimizers
from titanlike.optim.container import OptimizersContainer, optimizers_of
from titanlike.optim.loss_scale import LossScaler, SkipAwareLR
from titanlike.optim.lr import build_lr_scheduler
from titanlike.optim.master_muon import build_master_weight_muon
from titanlike.optim.master_weights import build_master_weight_adamw, mixed_precision_mode
from titanlike.resilience.nonfinite import NonFiniteGuard, skips_on_device


@dataclass(frozen=True)
class UpdateSections:
    """The config sections the Updater reads, built once by its caller (`UpdateSections.of(cfg)`)."""
    training: Training
    optimizer: Optimizer
    lr_scheduler: LRScheduler
    loss_scaling: LossScaling
    compile: Compile  # "optimizer" in components: the master-weight update compiles, and "auto" picks it
    checkpoint: Checkpoint  # enable + async_mode: pinned async saves need the master weights' state dict stable
    fault_tolerance: FaultTolerance  # enable: torchft's groups rule master weights and fp16 out

    @classmethod
    def of(cls, cfg: JobConfig) -> UpdateSections:
        return cls(cfg.training, cfg.optimizer, cfg.lr_scheduler, cfg.loss_scaling, cfg.compile, cfg.checkpoint,
                   cfg.fault_tolerance)


class Updater:
    def __init__(self, sections: UpdateSections, dims, device: torch.device, model_parts: list[torch.nn.Module],
                 io_modules: tuple[str, ...] = ()):
        """io_modules: the family's ModelSpec input_modules + output_modules (optimizer.name="Muon" gives them
        to AdamW)."""
        t, opt, comp, ckpt = sections.training, sections.optimizer, sections.compile, sections.checkpoint
        self.max_norm = t.max_norm
        # Who casts weights to the compute dtype: FSDP's policy, autocast, or bf16/fp16 weights + fp32 masters
        self.precision = mixed_precision_mode(t, comp, dims, device, fault_tolerant=sections.fault_tolerance.enable)
        if self.precision == "master_weights":
            compiled = comp.enable and "optimizer" in comp.components and device.type == "cuda"
            common = dict(accumulate_fp32=t.global_batch_size > t.local_batch_size, compile=compiled,
                          stable_state_dict=ckpt.enable and ckpt.async_mode == "async_with_pinned_mem",
                          dtype=getattr(torch, t.mixed_precision_param))
            if opt.name == "Muon":
                self.optimizer = build_master_weight_muon(model_parts[0], opt, io_modules=io_modules, **common)
            else:
                self.optimizer = build_master_weight_adamw(model_parts[0], opt, overlap=opt.overlap_with_forward,
                                                           **common)
        else:  # one optimizer per model part: each (part, optimizer) pair maps to the full model's FQNs
            optimizers = [build_optimizer(part, opt, device, io_modules) for part in model_parts]
            self.optimizer = optimizers[0] if len(optimizers) == 1 else OptimizersContainer(optimizers)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, sections.lr_scheduler, t.steps)
        # Fused AdamW clips inside its kernel (titanlike/optim/adamw.py): one pass over the fp32 gradients less.
        self.fused_clip = fused_clip_optimizers(self.optimizer)
        self.guard = (NonFiniteGuard(self.optimizer, device, t.max_consecutive_bad_steps)
                      if t.skip_nonfinite_steps else None)
        # fp16 (Megatron's --fp16): the loss is scaled before backward; overflowing steps are skipped and do not
        # advance the LR schedule
        self.scaler = LossScaler(sections.loss_scaling, device) if t.mixed_precision_param == "float16" else None
        if self.scaler is not None:
            self.lr_scheduler = SkipAwareLR(self.lr_scheduler, self.scaler)
            if self.guard is not None:  # a stop for overflows at the floor names the scale's keys
                self.guard.scale_advice = self.scaler.floor_advice
        self.step_lr = self.lr_scheduler.get_last_lr()[0]  # the LR of the last update, for the log

    @property
    def loss_scale(self) -> torch.Tensor | None:
        """fp16: the backward loss is multiplied by this (a device tensor); the clip divides it out again."""
        return self.scaler.scale if self.scaler is not None else None

    def clip(self, model: torch.nn.Module | list[torch.nn.Module] | None, pp=None) -> torch.Tensor:
        """Clip by the global gradient norm and return it (the true norm under fp16), without a host sync. `model`:
        the model, or the parts this rank holds (the memory estimate's pipeline stages, traced without a schedule)."""
        if pp is not None:  # over all stages
            return pp.clip_grad_norm_(self.max_norm, self.fused_clip, self.loss_scale)
        if self.precision == "master_weights":
            return self.optimizer.clip_grad_norm_(self.max_norm, self.loss_scale)
        parts = model if isinstance(model, list) else [model]
        params = [p for part in parts for p in part.parameters()]
        return clip_grad_norm_(params, self.max_norm, self.fused_clip, self.loss_scale)

    def apply(self, step: int, mb_losses: list[torch.Tensor], loss_sum: torch.Tensor, grad_norm: torch.Tensor,
              commit: bool) -> None:
        """The optimizer and LR steps (commit=False: torchft's quorum dropped the step, nothing moves), then the
        gradients are released."""
        self.step_lr = self.lr_scheduler.get_last_lr()[0]  # the LR of this update (fp16: settles the last step)
        if commit and self._may_update(step, mb_losses, grad_norm):
            self.optimizer.step()  # with fused AdamW a non-finite step is skipped inside the kernel (found_inf)
        if commit:
            self.lr_scheduler.step()
            if self.scaler is not None:
                self.scaler.update(loss_sum)
        self.optimizer.zero_grad(set_to_none=True)

    def _may_update(self, step: int, mb_losses: list[torch.Tensor], grad_norm: torch.Tensor) -> bool:
        """False when the host must skip optimizer.step(); on the device the optimizers' found_inf does it. A
        non-finite grad norm skips the step: under fp16 as an overflow (the scaler lowers the scale; the guard
        counts only overflows at the lowest scale), else through the guard."""
        if self.scaler is None:
            return self.guard is None or self.guard.before_optimizer_step(step, mb_losses, grad_norm)
        overflow = self.scaler.overflow(grad_norm)
        if self.guard is not None:
            self.guard.before_optimizer_step(step, mb_losses, grad_norm, bad=self.scaler.at_floor())
        if skips_on_device(self.optimizer):
            for opt in optimizers_of(self.optimizer):
                opt.found_inf = overflow
            return True
        return not bool(overflow.item())

    def log_counts(self) -> dict[str, float]:
        """For a log step (a host sync): fp16's loss scale, and the skipped / NaN-loss steps since the last one."""
        if self.scaler is not None:
            return self.scaler.log_metrics()
        return self.guard.interval_counts() if self.guard is not None else {}

    def state_dict(self) -> dict:
        return {"loss_scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and "loss_scaler" in state:  # (a bf16 checkpoint starts at the initial scale)
            self.scaler.load_state_dict(state["loss_scaler"])
