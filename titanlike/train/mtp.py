"""Multi-token prediction bookkeeping around the training step (models/common/mtp.py holds the modules).

- grad_scale: each MTP forward adds its losses' gradient itself (AuxLossGrad, as the MoE does), weighted by
  1 / micro-batches per step; FSDP's mean over the data ranks completes the average over the global batch.
- Metrics, on log steps only (a host sync, like the loss): the per-depth MTP losses averaged over the step's
  micro-batches and the data ranks, as `mtp/loss_<k>` (k = 1..D, depth k predicts token t+k+1), and
  `mtp/total_loss` = loss + (mtp_loss_weight / D) * sum_k mtp/loss_k, the objective the gradient follows. The
  trainer's `loss` stays the main LM loss alone, comparable with a run without MTP.
- Pipeline parallel: the modules sit on the last stage; on log steps their losses are summed over the pp ranks (the
  others add zeros), so rank 0, which logs, has them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from models.common.mtp import MTP


class MTPBookkeeping:
    def __init__(self, model_parts: list[nn.Module], dims, microbatches: int):
        self.modules = [m for part in model_parts for m in part.modules() if isinstance(m, MTP)]
        for m in self.modules:
            m.grad_scale = 1.0 / microbatches
        mesh = dims.get_mesh("dp_cp")
        self.group = mesh.get_group() if mesh is not None else None
        # Pipeline parallel: the modules live on the last stage, while rank 0 (first stage) logs. Every pp rank
        # learns the depth count and weight once, here, and joins a sum over pp on log steps.
        pp = dims.get_mesh("pp")
        self.pp_group = pp.get_group() if pp is not None else None
        self.depths, self.weight = (len(self.modules[0]), self.modules[0].weight) if self.modules else (0, 0.0)
        if self.pp_group is not None:
            held = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(held, (self.depths, self.weight), group=self.pp_group)
            self.depths, self.weight = max(held)

    def __bool__(self) -> bool:
        return self.depths > 0

    @torch.no_grad()
    def after_step(self, log: bool) -> dict[str, float]:
        """Call after each step on every rank: resets the accumulated losses; on log steps returns the metrics
        without mtp/total_loss (`with_total` adds it once the main loss is known)."""
        losses = None
        for m in self.modules:  # (one MTP per model: a pipeline holds it on one stage)
            losses = m.take_losses()
        if not log or not self:
            return {}
        if self.pp_group is not None:  # the last stage's losses to every pp rank (zeros elsewhere)
            if losses is None:
                losses = torch.zeros(self.depths, device=_device(self.pp_group))
            dist.all_reduce(losses, group=self.pp_group)
        if losses is None:
            return {}
        if self.group is not None:
            dist.all_reduce(losses, group=self.group)
            losses /= dist.get_world_size(self.group)
        return {f"mtp/loss_{k}": v for k, v in enumerate(losses.tolist(), start=1)}

    def with_total(self, loss: float, metrics: dict[str, float]) -> dict[str, float]:
        """metrics plus mtp/total_loss = loss + lambda / D * sum of the depths' losses (when there are any)."""
        depths = [v for k, v in metrics.items() if k.startswith("mtp/loss_")]
        if not depths or not self:
            return metrics
        return {**metrics, "mtp/total_loss": loss + self.weight * sum(depths)}


def _device(group) -> torch.device:
    """Where the group's collectives run: the GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")
