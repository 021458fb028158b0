"""DPO's loss: per-sequence log-probs of the responses, then one loss term per (chosen, rejected) pair.

Rows come in pairs, [c0, r0, c1, r1, ...] (titanlike/data/preference.py), with labels IGNORE_INDEX outside the
responses. For a row, logp = sum over its response tokens of log_softmax(logits)[label]; `ref` is the same for the
reference model. With Δ = (logp_c - ref_c) - (logp_r - ref_r), β = dpo.beta and ε = dpo.label_smoothing, a pair's
loss is (TRL's names; TRL >= 1.0 DPOTrainer._compute_loss, older TRL DPOTrainer.dpo_loss):

    sigmoid            -(1 - ε) log σ(β Δ) - ε log σ(-β Δ)                DPO (Rafailov et al. 2023); with ε > 0 the
                                                                          conservative DPO of Mitchell 2023 (TRL < 1.0
                                                                          "sigmoid" with label_smoothing)
    ipo                (Δ̄ - 1 / (2β))²                                    IPO (Azar et al. 2023, eq. 17)
    length_normalized  -(1 - ε) log σ(β Δ̄) - ε log σ(-β Δ̄)               TRL's "sigmoid_norm", Tulu 3's "dpo_norm"

where Δ̄ is Δ with every log-prob divided by its row's response length (policy and reference alike, so
Δ̄ = (logp_c - ref_c) / |y_c| - (logp_r - ref_r) / |y_r|): per-token mean log-probs. TRL computes its "ipo" that way
too (the IPO authors' normalised form). This is not SimPO (Meng et al. 2024), which drops the reference and adds a
margin.

The summed loss over the micro-batch's pairs is returned; the trainer divides by the global count of pairs (the
Batch's row_targets: 1 on each pair's chosen row). Rewards β·(logp - ref) (the loss's own, mean-based for the
normalised types) feed the logged reward accuracy and margin, accumulated on the device between log steps.

Context parallel: each CP rank holds load-balanced chunks of every row (titanlike/train/batch.py), so its log-prob
sums are partial; they are summed over the CP ranks (differentiably, SumOverRanks) before the loss, which every CP
rank then holds whole. Each returns its 1/cp share of it, as CP ranks return their tokens' share of a cross-entropy:
the trainer sums the losses over data x context ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from models.batch import IGNORE_INDEX
from titanlike.config.validate_dpo import DPO_LOSS_TYPES
from titanlike.train.dpo_packed import segment_logps
from titanlike.train.loss import plain_loss

NORMALISED = ("ipo", "length_normalized")  # the loss types on per-token mean log-probs


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over each row's targets of log p(label) [R] in fp32, each row's target count [R]) of logits [R, S, V]
    and labels [R, S]. Vocabulary-sharded logits (TP's loss parallel) work inside loss_parallel()."""
    tok = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none",
                          ignore_index=IGNORE_INDEX)
    tok = plain_loss(tok)  # (a replicated DTensor under loss parallel)
    return -tok.view(labels.shape).sum(dim=1), (labels != IGNORE_INDEX).sum(dim=1)


class SumOverRanks(torch.autograd.Function):
    """Sum of x over the ranks of `group`, whose backward sums the gradients over them as well: every rank computes
    its share of a loss from the sum, and each rank's part of the sum feeds all of those shares."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def pair_losses(delta: torch.Tensor, loss_type: str, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-pair loss of Δ (the difference of the chosen and rejected log-ratios; mean-based for NORMALISED)."""
    if loss_type == "ipo":
        return (delta - 1 / (2 * beta)) ** 2
    if loss_type in ("sigmoid", "length_normalized"):
        return (-(1 - label_smoothing) * F.logsigmoid(beta * delta)
                - label_smoothing * F.logsigmoid(-beta * delta))
    raise ValueError(f"dpo.loss_type={loss_type!r} is not one of {', '.join(DPO_LOSS_TYPES)}")


def pair_deltas(logps: torch.Tensor, ref_logps: torch.Tensor, lengths: torch.Tensor,
                normalised: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen log-ratio [P], rejected log-ratio [P], whether each pair is there [P]) of sequences [c0, r0, c1, r1,
    ...]: rows [2P] (padded layout) or the slots of packed rows [R, 2P/R], whose empty slots (length 0) hold no pair.
    Per token when normalised."""
    if logps.shape[-1] % 2:  # (a pipeline's micro-batches hold whole pairs: pp_microbatches divides the local pairs)
        raise ValueError(f"DPO: {logps.shape[-1]} rows do not make whole (chosen, rejected) pairs")
    ratio = logps - ref_logps.to(logps.dtype)
    if normalised:
        ratio = ratio / lengths.clamp(min=1).to(ratio.dtype)
    pairs = ratio.reshape(-1, 2)
    there = lengths.reshape(-1, 2)[:, 0] > 0 if logps.ndim == 2 else torch.ones_like(pairs[:, 0], dtype=torch.bool)
    return pairs[:, 0], pairs[:, 1], there


class DPOLoss:
    """The trainer's loss_fn for DPO: (logits [2P, S, V], labels [2P, S], reference_logps [2P]) -> summed loss over
    the P pairs (its 1/cp share under context parallel); packed rows (titanlike/train/dpo_packed.py): logits
    [R, S, V], labels [R, S, 2] (label, sequence number), reference_logps [R, slots]. Keeps device sums for the log
    (only while gradients are on: validation does not mix in). `cp_group`: the CP ranks that share each row, None
    without context parallel; `slots`: sequence slots per packed row."""

    def __init__(self, beta: float, loss_type: str, label_smoothing: float = 0.0, cp_group=None, slots: int = 0):
        if loss_type not in DPO_LOSS_TYPES:
            raise ValueError(f"dpo.loss_type={loss_type!r} is not one of {', '.join(DPO_LOSS_TYPES)}")
        self.beta, self.loss_type, self.label_smoothing = beta, loss_type, label_smoothing
        self.logps_fn = sequence_logps  # (compiled by the trainer with compile.components "loss")
        self.segment_fn = segment_logps  # packed rows (compiled likewise)
        self.slots = slots
        self.cp_group = cp_group
        self.cp_degree = dist.get_world_size(cp_group) if cp_group is not None else 1
        self._stats: torch.Tensor | None = None  # pairs, correct, margin, chosen reward, rejected reward (sums)

    def row_logps(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """sequence_logps of whole rows ([R] each), or segment_logps of packed rows ([R, slots] each): under context
        parallel the sums of this rank's chunks, summed over the CP ranks (the log-probs differentiably)."""
        if labels.ndim == 3:
            logps, lengths = self.segment_fn(logits, labels, self.slots)
        else:
            logps, lengths = self.logps_fn(logits, labels)
        if self.cp_group is not None:
            logps = SumOverRanks.apply(logps, self.cp_group)
            lengths = lengths.clone()
            dist.all_reduce(lengths, group=self.cp_group)
        return logps, lengths

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, reference_logps: torch.Tensor) -> torch.Tensor:
        logps, lengths = self.row_logps(logits, labels)
        chosen, rejected, there = pair_deltas(logps, reference_logps, lengths, self.loss_type in NORMALISED)
        losses = pair_losses(chosen - rejected, self.loss_type, self.beta, self.label_smoothing)
        losses = torch.where(there, losses, torch.zeros_like(losses))  # (packed rows' empty slots)
        if torch.is_grad_enabled():
            with torch.no_grad():
                w = there.float()
                rc, rr = self.beta * chosen.detach() * w, self.beta * rejected.detach() * w
                stats = torch.stack([w.sum(), ((rc > rr).float() * w).sum(), (rc - rr).sum(), rc.sum(), rr.sum()])
                self._stats = stats if self._stats is None else self._stats + stats
        return losses.sum() / self.cp_degree

    def take_metrics(self, sum_over_ranks, device: torch.device | None = None) -> dict[str, float]:
        """Means over the pairs trained on since the last call, over all ranks (`sum_over_ranks`: an all-reduce that
        every rank calls on the same steps; a pipeline rank without the last stage adds zeros), then reset; {} when
        there were none. Reads the device: call on log steps."""
        stats = self._stats.clone() if self._stats is not None else torch.zeros(5, device=device)
        self._stats = None
        stats = sum_over_ranks(stats)
        n = float(stats[0])
        if n == 0:
            return {}
        acc, margin, chosen, rejected = (float(v) / n for v in stats[1:])
        return {"dpo/reward_accuracy": acc, "dpo/reward_margin": margin, "dpo/chosen_reward": chosen,
                "dpo/rejected_reward": rejected}
