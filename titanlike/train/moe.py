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
  tokens over the mean, worst layer and mean over layers), the dropped-assignment share, the bias spread. Under
  pipeline parallelism a rank holds the layers of its own stages only, so each rank's per-layer figures are gathered
  over the "pp" ranks (one object all-gather, on log steps only) and every rank logs the whole model's, as one
  process would.
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
        pp = dims.get_mesh("pp")
        self.pp_group = pp.get_group() if pp is not None else None
        # Whether any stage has MoE layers: a pp rank whose stages have none must still join the metrics' gather.
        self.any_layers = bool(self.layers)
        if self.pp_group is not None:  # once, at start-up
            held = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(held, len(self.layers), group=self.pp_group)
            self.any_layers = any(held)

    def __bool__(self) -> bool:
        return self.any_layers

    def _global_counts(self) -> torch.Tensor:
        counts = torch.stack([m.tokens_per_expert for _, m in self.layers])
        if self.group is not None:
            dist.all_reduce(counts, group=self.group)
        return counts

    @torch.no_grad()
    def after_step(self, log: bool) -> dict[str, float]:
        """Call after optimizer.step() on every rank: updates the expert biases (when balancing), resets the
        counters; on log steps returns the metrics (a host sync, like the loss)."""
        if not self.any_layers:
            return {}
        if not self.layers:  # a pp rank without MoE layers: only the metrics' gather over pp
            return self._metrics(None) if log else {}
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

    def _local(self, counts: torch.Tensor | None) -> dict:
        """This rank's share of the metrics, as Python numbers: sums over its layers and each layer's figures."""
        if not self.layers:
            return {"dropped": 0.0, "assigned": 0.0, "layers": {}}
        load = counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-9)  # per layer: busiest / mean
        aux = torch.stack([m.last_aux_loss.float() for _, m in self.layers])
        dropped = torch.stack([m.dropped_assignments for _, m in self.layers]).sum()
        if self.group is not None:
            dist.all_reduce(dropped, group=self.group)
        bias = torch.stack([m.expert_bias.float() for _, m in self.layers]).std(dim=1)
        # counts.sum(): the routers' demand, kept and dropped
        n, values = len(self.layers), torch.cat([torch.stack([dropped, counts.sum()]), aux, load, bias]).tolist()
        per_layer = zip(values[2:2 + n], values[2 + n:2 + 2 * n], values[2 + 2 * n:])
        return {"dropped": values[0], "assigned": values[1],
                "layers": {name: layer for (name, _), layer in zip(self.layers, per_layer)}}

    def _metrics(self, counts: torch.Tensor | None) -> dict[str, float]:
        shares = [self._local(counts)]
        if self.pp_group is not None:  # every stage's layers (module doc); rank 0, which logs, holds the first only
            shares = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(shares, self._local(counts), group=self.pp_group)
        layers = {name: v for share in shares for name, v in share["layers"].items()}
        aux, load, bias = zip(*layers.values())  # per layer, in stage order
        dropped, assigned = sum(x["dropped"] for x in shares), sum(x["assigned"] for x in shares)
        out = {"moe/aux_loss": sum(aux), "moe/load_max_over_mean": max(load),
               "moe/load_mean_over_layers": sum(load) / len(load), "moe/dropped_pct": 100 * dropped / max(assigned, 1),
               "moe/bias_std": sum(bias) / len(bias)}
        out.update({f"moe/load/{name}": v[1] for name, v in layers.items()})
        return out
