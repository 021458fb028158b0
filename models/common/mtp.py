"""Multi-token prediction (DeepSeek-V3 report §2.2, Megatron-LM's --mtp-num-layers): D sequential modules after the
main decoder, module k (1..D) predicting token t+k+1 at position t.

    h^0      = the main model's final hidden state after its final norm (what the output head reads; Megatron and
               SGLang feed the MTP module that, and hnorm normalises it again)
    h'^k     = eh_proj([enorm(Emb(t_{i+k})) ; hnorm(h^{k-1})])      embedding first, as Megatron, SGLang and the
               published checkpoint's eh_proj [dim, 2*dim] order it (the report writes the halves the other way)
    h^k      = norm_k(block_k(h'^k))                                the family's own decoder block, then this
               module's own final norm (the checkpoint's shared_head.norm; Megatron's final_layernorm)
    logits^k = output(h^k)                                          the main model's output head and embedding
               are shared (the same modules, not copies)
    loss     = main loss + (mtp_loss_weight / D) * sum_k loss_k

The MTP losses never reach the loss function: the forward adds their gradient through AuxLossGrad on the main
hidden state (as the MoE's auxiliary losses do, and as Megatron's MTPLossAutoScaler does), so the trainer's `loss`
stays the main LM loss, comparable to a run without MTP. Each loss_k is this micro-batch's mean over its own
targets, weighted by `grad_scale` (the trainer sets 1 / micro-batches per step; FSDP averages the data ranks):
Megatron's normalisation without calculate_per_token_loss.

Targets, depth k, position t: the loader's label at t+k (the token t+k+1), ignored where t+k is past the row or in
another document than t (doc_ids), or where that label is ignored. The block attends with the main model's RoPE
rows and document mask. Computed only while autograd records (training): validation and generation skip it.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from models.batch import IGNORE_INDEX, Batch, StepContext
from models.common.norms import RMSNorm
from models.common.router import AuxLossGrad

MTP_INPUT = "mtp_labels"  # the Batch input carrying the loader's labels to the forward (the MTP targets' source)
# The Batch input carrying the whole input ids (the embedding input t+k): under context parallel the shift by k
# reads tokens and labels of the next CP chunk, so both stay whole on every CP rank (not in Batch.sequence).
MTP_TOKENS = "mtp_tokens"
# parallelize/pp_split.py's SPLIT_BACKWARD_SCHEDULES (models/ imports nothing of parallelize/): refused with MTP, whose
# side branch torch's split input/weight backward fails on ("Trying to backward through the graph a second time")
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def shifted_targets(labels: torch.Tensor, k: int, doc_ids: torch.Tensor | None) -> torch.Tensor:
    """[B, S] targets of depth k: labels[:, t + k], IGNORE_INDEX past the row end and across a document end."""
    s = labels.shape[1]
    out = torch.full_like(labels, IGNORE_INDEX)
    if k >= s:
        return out
    out[:, : s - k] = labels[:, k:]
    if doc_ids is not None:
        same = torch.zeros_like(labels, dtype=torch.bool)
        same[:, : s - k] = doc_ids[:, k:] == doc_ids[:, : s - k]
        out = out.masked_fill(~same, IGNORE_INDEX)
    return out


def shifted_tokens(tokens: torch.Tensor, k: int) -> torch.Tensor:
    """[B, S] the embedding input of depth k: tokens[:, t + k]; past the row end the row's last token (those
    positions have no target, and causal attention lets no earlier position see them)."""
    s = tokens.shape[1]
    idx = (torch.arange(s, device=tokens.device) + k).clamp_max(s - 1)
    return tokens[:, idx]


def head_loss(head: nn.Module, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy (fp32) of head(h) against labels. The trainer's chunked LM head
    (titanlike.train.loss.ChunkedLossLinear, recognised by its `chunk_tokens`: models/ imports nothing of titanlike)
    returns the summed loss itself while it holds labels: it gets this depth's labels for the call."""
    if hasattr(head, "chunk_tokens"):
        saved = head._labels
        head._labels = labels
        try:
            return head(h)
        finally:
            head._labels = saved
    logits = head(h)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum",
                           ignore_index=IGNORE_INDEX)


class MTPLayer(nn.Module):
    """One MTP module; its FQNs (enorm, hnorm, eh_proj, block.*, norm) are what hf.py maps to the published
    layer's (enorm, hnorm, eh_proj, the usual layer weights, shared_head.norm)."""

    def __init__(self, dim: int, norm_eps: float, block: nn.Module) -> None:
        super().__init__()
        self.enorm = RMSNorm(dim, eps=norm_eps)
        self.hnorm = RMSNorm(dim, eps=norm_eps)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = RMSNorm(dim, eps=norm_eps)

    def forward(self, h: torch.Tensor, emb: torch.Tensor, rope: torch.Tensor, mask) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))
        return self.norm(self.block(x, rope, mask))

    def init_weights(self) -> None:
        for norm in (self.enorm, self.hnorm, self.norm):
            norm.reset_parameters()
        std = 0.02  # an input projection, like the attention's (the block's outputs are depth-scaled by the block)
        nn.init.trunc_normal_(self.eh_proj.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
        self.block.init_weights()


class MTP(nn.ModuleDict):
    """The D modules, keyed "0".."D-1" (checkpoint names mtp.<k-1>.*), with the loss bookkeeping.

    `block(layer_id, args)` is the family's decoder block: module k gets layer_id n_layers + k - 1, the place the
    published DeepSeek-V3 checkpoint gives it (so a dense-or-MoE rule by layer id makes it MoE there, as published)
    and the depth its residual projections' init std follows."""

    def __init__(self, args: Any, block: Callable[[int, Any], nn.Module]) -> None:
        super().__init__({str(k): MTPLayer(args.dim, args.norm_eps, block(args.n_layers + k, args))
                          for k in range(args.mtp_num_layers)})
        self.weight = args.mtp_loss_weight / args.mtp_num_layers  # lambda / D
        self.grad_scale = 1.0  # set by the trainer: this micro-batch's weight (1 / micro-batches per step)
        # (head, h, targets) -> summed loss as a plain tensor. Tensor parallel's loss parallel replaces it
        # (parallelize/mtp.py): there the head's logits are vocabulary-sharded and the loss comes back a DTensor.
        self.head_loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = head_loss
        # Detached per-depth means summed over the forwards since the trainer last read them (metrics only).
        self.loss_sums: torch.Tensor | None = None
        self.passes = 0

    def forward(self, h: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor | None,
                rope: torch.Tensor, mask, embed: nn.Module, head: nn.Module, cp_shard: tuple | None = None
                ) -> torch.Tensor:
        """h: the main hidden state [B, S, dim] (after the final norm); returns it unchanged, with the weighted
        MTP losses attached to its gradient. tokens, labels [B, S_full]: the whole sequences.

        cp_shard (context parallel, the model's CPShard): h holds this rank's load-balanced chunks of sequences of
        S_full = S * degree tokens. The shifted inputs and targets are cut from the whole sequences at this rank's
        positions (so t+k past a chunk end reads the next chunk, and document ends are the whole sequence's), and
        loss_k is this rank's summed loss over the whole sequences' target count times the degree: the mean over
        the CP ranks, which the gradient's average over them takes, is the one-process loss."""
        index, scale = None, 1.0
        if cp_shard is not None:
            from models.common.masks import chunk_positions, load_balanced_chunks

            rank, degree = cp_shard[0], cp_shard[1]
            index = chunk_positions(load_balanced_chunks(tokens.shape[1], rank, degree), h.device)
            scale = float(degree)
        losses = []
        prev = h
        for k, layer in enumerate(self.values(), start=1):
            shifted = shifted_tokens(tokens, k)
            targets = shifted_targets(labels, k, doc_ids)
            count = (targets != IGNORE_INDEX).sum().clamp_min(1)  # the whole sequences' targets
            if index is not None:
                shifted, targets = shifted[:, index], targets[:, index]
            prev = layer(prev, embed(shifted), rope, mask)
            losses.append(self.head_loss(head, prev, targets) * scale / count)
        losses = torch.stack(losses)
        done = losses.detach().float()
        self.loss_sums = done if self.loss_sums is None else self.loss_sums + done
        self.passes += 1
        return AuxLossGrad.apply(h, losses.sum() * self.weight, self.grad_scale)

    def take_losses(self) -> torch.Tensor | None:
        """The per-depth mean losses [D] over the forwards since the last call (None if none), and reset."""
        if self.loss_sums is None:
            return None
        out = self.loss_sums / self.passes
        self.loss_sums, self.passes = None, 0
        return out

    def init_weights(self) -> None:
        for layer in self.values():
            layer.init_weights()


def mtp_problems(args: Any, par: Any, seq_len: int | None = None) -> list[str]:
    """Config problems of MTP (one line each), for a family's check: nothing when mtp_num_layers = 0."""
    d = getattr(args, "mtp_num_layers", 0)
    if d == 0:
        return []
    out = []
    if d < 0:
        out.append(f"model.args.mtp_num_layers={d} is negative; use 0 (off) or a depth >= 1")
    seq = seq_len if seq_len is not None else args.max_seq_len
    if d >= seq:
        out.append(f"model.args.mtp_num_layers={d} leaves no target in sequences of {seq} tokens; use a depth "
                   f"below training.seq_len")
    schedule = getattr(par, "pp_schedule", None)  # (the config's Parallelism; ParallelDims has no schedule)
    if getattr(par, "pp", 1) > 1 and schedule in SPLIT_BACKWARD_SCHEDULES:
        out.append(f"model.args.mtp_num_layers={d} with parallelism.pp_schedule={schedule!r}: zero-bubble schedules "
                   f"split the last stage's backward into input and weight passes, which the MTP losses' gradient "
                   f"(attached to the stage's hidden state) does not survive; use 1F1B, Interleaved1F1B, GPipe or "
                   f"LoopedBFS, or mtp_num_layers=0")
    if args.mtp_loss_weight < 0:
        out.append(f"model.args.mtp_loss_weight={args.mtp_loss_weight} is negative; use a weight >= 0 (0.1: "
                   f"Megatron's --mtp-loss-scaling-factor default)")
    return out


class MTPNextToken:
    """Next-token objective that also hands the loader's labels and input ids to the forward (as `mtp_labels`,
    `mtp_tokens`: whole sequences, which context parallel does not cut), which the MTP modules shift into their
    targets and embedding inputs. The main loss is the usual cross-entropy of `labels`."""
    loss = "cross_entropy"

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor, ctx: StepContext) -> Batch:
        return Batch(inputs={"tokens": input_ids, MTP_INPUT: labels, MTP_TOKENS: input_ids}, labels=labels,
                     sequence=("tokens", "labels"))


def mtp_objective(args: Any):
    """A family's ModelSpec.objective: plain next-token without MTP (exactly as "next_token"), MTPNextToken with."""
    from models.batch import NextToken

    return MTPNextToken() if getattr(args, "mtp_num_layers", 0) > 0 else NextToken()
