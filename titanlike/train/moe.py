"""Mixture-of-experts bookkeeping around the training step (models/common/moe.py holds the layer itself).

- aux_grad_scale: each MoE layer adds its auxiliary losses' gradient in its own backward (so it works under pipeline
  parallelism, where the loss function never sees them). A rank runs `microbatches` forward passes per optimizer
  step and FSDP averages over the data-parallel ranks, so each pass's auxiliary loss is weighted 1 / microbatches:
  the gradient is that of the auxiliary loss averaged over every micro-batch of the global batch.
- Auxiliary-loss-free balancing: after each optimizer step the per-expert token counts of the step are summed over
  the data-parallel ranks (expert-parallel ranks are among them) and every layer's expert bias moves towards
  balance (update_expert_bias), outside autograd. Counts and biases are per layer, so a pipeline rank updates the
  layers of its own stages.
- Metrics, on log steps only (they read device tensors): the auxiliary losses, expert load (the busiest expert's
  tokens over the mean, worst layer and mean over layers), the dropped-assignment share, the bias spread.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from models.common.moe import MoE, update_expert_bias


class MoEBookkeeping:
    def __init__(self, model_parts: list[nn.Module], dims, microbatches: int):
        self.layers: list[tuple[str, MoE]] = [(name, m) for part in model_parts for name, m in part.named_modules()
                                              if isinstance(m, MoE)]
        for _, m in self.layers:
            m.aux_grad_scale = 1.0 / microbatches
        mesh = dims.get_mesh("dp_cp")
        self.group = mesh.get_group() if mesh is not None else None
        self.balancing = any(m.args.bias_update_rate > 0 for _, m in self.layers)

    def __bool__(self) -> bool:
        return bool(self.layers)

    def _global_counts(self) -> torch.Tensor:
        counts = torch.stack([m.tokens_per_expert for _, m in self.layers])
        if self.group is not None:
            dist.all_reduce(counts, group=self.group)
        return counts

    @torch.no_grad()
    def after_step(self, log: bool) -> dict[str, float]:
        """Call after optimizer.step() on every rank: updates the expert biases (when balancing), resets the
        counters; on log steps returns the metrics (a host sync, like the loss)."""
        if not self.layers:
            return {}
        counts = self._global_counts() if self.balancing or log else None
        if self.balancing:
            for (_, m), c in zip(self.layers, counts):
                if m.args.bias_update_rate > 0:
                    update_expert_bias(m, c)
        out = self._metrics(counts) if log else {}
        for _, m in self.layers:
            m.tokens_per_expert.zero_()
            m.dropped_assignments.zero_()
        return out

    def _metrics(self, counts: torch.Tensor) -> dict[str, float]:
        load = counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-9)  # per layer: busiest / mean
        aux = torch.stack([m.last_aux_loss.float() for _, m in self.layers]).sum()
        dropped = torch.stack([m.dropped_assignments for _, m in self.layers]).sum()
        if self.group is not None:
            dist.all_reduce(dropped, group=self.group)
        assigned = counts.sum()  # the routers' demand: kept and dropped
        bias = torch.stack([m.expert_bias.float() for _, m in self.layers])
        values = torch.stack([aux, load.max(), load.mean(), 100 * dropped / assigned.clamp_min(1),
                              bias.std(dim=1).mean(), *load]).tolist()
        out = {"moe/aux_loss": values[0], "moe/load_max_over_mean": values[1], "moe/load_mean_over_layers": values[2],
               "moe/dropped_pct": values[3], "moe/bias_std": values[4]}
        out.update({f"moe/load/{name}": v for (name, _), v in zip(self.layers, values[5:])})
        return out
