"""The MoE router (gate, scores, group-limited top-k) and the load-balancing losses computed from its outputs.

Used by models/common/moe.py (MoE, MoEArgs); kept apart so each file stays one responsibility. Everything here runs
in fp32 whatever the model's dtype: the softmax/sigmoid, the top-k choice and the balance losses are sensitive to
bf16 rounding (near-ties flip experts), and the gate is a tiny matmul (dim x num_experts).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from models.common.moe_args import MoEArgs


class Router(nn.Module):
    """Scores every expert for every token and picks top_k of them.

    Selection uses `scores + expert_bias` (auxiliary-loss-free balancing: the bias steers which experts are chosen);
    the routing weights come from the unbiased scores, so the bias never scales an expert's output. With n_groups > 1
    (DeepSeek-V3's group-limited routing) the experts form n_groups contiguous groups, each group is rated by the sum
    of its two best (biased) scores, and only the experts of the topk_groups best groups are eligible.
    """

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.gate = nn.Linear(dim, args.num_experts, bias=False)
        self.num_experts = args.num_experts
        self.top_k = args.top_k
        self.score_func = args.score_func
        self.route_norm = args.route_norm
        self.route_scale = args.route_scale
        self.n_groups = args.n_groups
        self.topk_groups = args.topk_groups

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None = None):
        """x [T, dim] -> (indices [T, k] int64, weights [T, k] fp32, scores [T, E] fp32, logits [T, E] fp32).

        The gate's weight is read directly rather than through `self.gate(x)`: that keeps the logits in fp32 under
        autocast, bf16 parameters and a float8 conversion of the Linear alike (the weight's upcast is exact).
        """
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.gate.weight.float())
        scores = torch.sigmoid(logits) if self.score_func == "sigmoid" else torch.softmax(logits, dim=-1)
        choice = scores if expert_bias is None else scores + expert_bias.float()
        if self.n_groups > 1:
            choice = self._mask_groups(choice)
        indices = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(-1, indices)
        if self.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.route_scale != 1.0:
            weights = weights * self.route_scale
        return indices, weights, scores, logits

    def _mask_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Selection scores with the experts outside each token's topk_groups best groups set to -inf."""
        t, e = choice.shape
        per_group = e // self.n_groups
        grouped = choice.view(t, self.n_groups, per_group)
        # DeepSeek-V3 rates a group by its two best experts (one when a group has a single expert): robust to one
        # outlier expert, unlike the max, and cheaper than the sum.
        group_score = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)
        best = group_score.topk(self.topk_groups, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e)

    def init_weights(self, init_std: float) -> None:
        # The depth-scaled std keeps the initial logits small: routing starts near uniform, so no expert is starved
        # before the balancing terms can act.
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=init_std, a=-3 * init_std, b=3 * init_std)


def routing_probs(scores: torch.Tensor, score_func: str) -> torch.Tensor:
    """Per-token probabilities over experts for the balance losses: softmax scores as they are; sigmoid scores
    divided by their sum over experts (DeepSeek-V3), since independent sigmoids do not sum to 1."""
    if score_func == "sigmoid":
        return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    return scores


def expert_counts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routed assignments per expert over the last two dims of indices [..., T, k] -> [..., E] fp32.

    scatter_add rather than bincount: bincount sizes its output from the data (a host sync on CUDA)."""
    flat = indices.flatten(-2)
    out = torch.zeros(*flat.shape[:-1], num_experts, dtype=torch.float32, device=indices.device)
    return out.scatter_add_(-1, flat, torch.ones_like(flat, dtype=torch.float32))


def load_balance_loss(probs: torch.Tensor, indices: torch.Tensor, num_experts: int,
                      shard_mean: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Switch/GShard auxiliary loss E * sum_e f_e * P_e over all tokens: f_e the fraction of the T*k routed
    assignments that went to e, P_e the mean probability of e. 1.0 when perfectly balanced. Only P carries gradient.

    probs [T, E] (routing_probs), indices [T, k]. shard_mean: see MoE.shard_mean (the loads f of the whole sequences
    when this rank holds equal shares of them; P stays local, and the mean of the shares' losses is the loss)."""
    t, k = indices.shape
    f = expert_counts(indices, num_experts) / (t * k)
    if shard_mean is not None:
        f = shard_mean(f)
    return num_experts * (f * probs.mean(dim=0)).sum()


def seq_balance_loss(probs: torch.Tensor, indices: torch.Tensor, num_experts: int,
                     shard_mean: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss: load_balance_loss within each sequence, averaged over sequences.

    probs [B, S, E], indices [B, S, k]. shard_mean: as load_balance_loss, per sequence."""
    _, s, k = indices.shape
    f = expert_counts(indices, num_experts) / (s * k)  # [B, E]
    if shard_mean is not None:
        f = shard_mean(f)
    return (num_experts * (f * probs.mean(dim=1)).sum(dim=-1)).mean()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: mean over tokens of logsumexp(logits)^2; keeps the logits from drifting large."""
    return torch.logsumexp(logits, dim=-1).square().mean()


class AuxLossGrad(torch.autograd.Function):
    """Returns `out` unchanged; in backward passes `out`'s gradient through and gives `aux` the gradient `scale`.

    The auxiliary losses thereby reach the router's gradient without being added to the training loss: nothing
    outside the MoE layer (loss function, pipeline schedule, compiled region boundary) has to carry them. `scale`
    (a float or 0-dim tensor) is the weight of this micro-batch's aux loss, which the trainer sets to match how it
    scales the main loss."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale):
        ctx.scale = scale
        ctx.aux_dtype, ctx.aux_device = aux.dtype, aux.device
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_aux = torch.ones((), dtype=ctx.aux_dtype, device=ctx.aux_device) * ctx.scale
        return grad_out, grad_aux, None
