"""BERT's objective: masked-LM on plain token data, or Megatron's pretraining batch (masked tokens, token types,
padding mask, MLM targets and the sentence-order label) from `data.dataset = "bert"`.

Two loader layouts, told apart by the batch's rank:
- plain tokens (input_ids [B, S]): models/batch.py's MaskedLM draws the masks (80/10/10) and the loss is the summed
  MLM cross-entropy; the binary head has no label here, so a run asking for it is refused (`data_problem`).
- Megatron's BERT data (titanlike/data/bert_dataset.py: input_ids [B, 3, S] = masked tokens, token types, padding
  mask; labels [B, S + 1] = MLM targets with -100 elsewhere, then the sentence-order label): the data has masked
  already, so nothing is drawn here. The Batch: tokens primary, `token_types` and `attention_mask` named inputs
  (every pipeline stage gets them), the labels as they are.

Normalisation: the MLM term is a mean over the step's masked tokens and the sentence-order term a mean over its
samples, on any layout. The trainer divides one summed loss by one global count (the masked tokens, `row_targets`);
the sentence-order labels are the Batch's `row_aux`, whose global count the trainer takes in the same all-reduce and
hands back as `extras["aux_scale"]` = masked tokens / samples (titanlike/train/batch.py: per_sample_scale), by which
each sample's cross-entropy is multiplied. Megatron's pretrain_bert.py takes both means per micro-batch and averages
the micro-batches uniformly; the two agree when the micro-batches hold as many masked tokens and samples.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from models.batch import IGNORE_INDEX, Batch, MaskedLM, StepContext, masked_lm


def bert_loss(output, labels: torch.Tensor, aux_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Summed loss of a micro-batch: MLM cross-entropy over its targets (fp32) + the sentence-order cross-entropy of
    each sample times `aux_scale` (when the model has the binary head and the labels carry the order label).
    output: MLM logits [B, S, V] or (them, binary logits [B, 2]); labels [B, S] (plain data) or [B, S + 1].
    Without aux_scale (a caller outside the trainer's step, e.g. the memory estimate's trace) the micro-batch's own
    masked tokens per sample stand in for the step's."""
    logits, binary = output if isinstance(output, tuple) else (output, None)
    s = logits.shape[1]
    mlm = F.cross_entropy(logits.flatten(0, 1).float(), labels[:, :s].flatten(), reduction="sum",
                          ignore_index=IGNORE_INDEX)
    if binary is None or labels.shape[1] == s:
        return mlm
    sop = F.cross_entropy(binary.float(), labels[:, s], reduction="none", ignore_index=IGNORE_INDEX)
    if aux_scale is None:
        aux_scale = (labels[:, :s] != IGNORE_INDEX).sum().float() / (labels[:, s] != IGNORE_INDEX).sum().clamp(min=1)
    else:
        aux_scale = aux_scale[0] if aux_scale.ndim else aux_scale  # per row, all equal (a pipeline may cut the rows)
    return mlm + sop.sum() * aux_scale


def bert_metrics(output, batch: Batch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Validation metrics as (sum, count) pairs, which the evaluator adds up over batches and ranks before dividing
    (titanlike/train/evaluate.py): the MLM loss alone (the validation loss adds the sentence-order term), MLM
    accuracy (masked positions whose argmax is the label) and, with the binary head on labelled data, sentence-order
    accuracy."""
    logits, binary = output if isinstance(output, tuple) else (output, None)
    labels = batch.labels
    s = logits.shape[1]
    mlm_labels = labels[:, :s]
    masked = mlm_labels != IGNORE_INDEX
    n = masked.sum()
    mlm = F.cross_entropy(logits.flatten(0, 1).float(), mlm_labels.flatten(), reduction="sum",
                          ignore_index=IGNORE_INDEX)
    out = {"mlm_loss": (mlm, n), "mlm_accuracy": (((logits.argmax(-1) == mlm_labels) & masked).sum(), n)}
    if binary is not None and labels.shape[1] > s:
        order = labels[:, s]
        has = order != IGNORE_INDEX
        out["sop_accuracy"] = (((binary.argmax(-1) == order) & has).sum(), has.sum())
    return out


@dataclass(frozen=True)
class BertPretraining:
    masked: MaskedLM  # plain token data: the masks are drawn here
    binary_head: bool  # model.args.binary_head: the forward returns (MLM logits, binary logits)
    # the summed loss (titanlike/train/loss.py objective_loss takes a callable as well as a LOSSES name)
    loss = staticmethod(bert_loss)
    eval_metrics = staticmethod(bert_metrics)  # validation's MLM loss and accuracies (titanlike/train/evaluate.py)

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor, ctx: StepContext) -> Batch:
        if input_ids.ndim == 2:
            return self.masked(input_ids, labels, ctx)
        if input_ids.ndim != 3 or input_ids.shape[1] != 3 or labels.shape[1] != input_ids.shape[2] + 1:
            raise ValueError(f"bert objective: expected data.dataset=\"bert\" batches (input_ids [B, 3, S], labels "
                             f"[B, S + 1]) or plain tokens [B, S]; got {tuple(input_ids.shape)} / "
                             f"{tuple(labels.shape)}")
        s = input_ids.shape[2]
        targets = (labels[:, :s] != IGNORE_INDEX).sum(dim=1)  # the MLM terms of each row: the trainer's count
        # the sentence-order labels: the per-sample part of the loss (the trainer's aux_scale makes it a mean)
        samples = (labels[:, s] != IGNORE_INDEX).long() if self.binary_head else None
        return Batch(inputs={"tokens": input_ids[:, 0], "token_types": input_ids[:, 1],
                             "attention_mask": input_ids[:, 2]},
                     labels=labels, sequence=("tokens", "token_types", "attention_mask"),
                     row_targets=targets, row_aux=samples)

    def tokenizer_problem(self, tokenizer: Any) -> str | None:
        return self.masked.tokenizer_problem(tokenizer)

    def data_problem(self, data: Any) -> str | None:
        """Why the binary head cannot train on this data, or None (one line naming the keys)."""
        dataset, labelled = getattr(data, "dataset", ""), getattr(data, "binary_head", False)
        if dataset != "bert":
            if self.binary_head:
                return (f"model.args.binary_head=true: the sentence-order loss needs its label, which "
                        f"data.dataset={dataset!r} has not; use data.dataset=\"bert\" (sentence-split data) or set "
                        f"model.args.binary_head=false")
            return None
        if self.binary_head and not labelled:
            return ("model.args.binary_head=true but data.binary_head=false: the data draws no sentence-order label; "
                    "set both true (Megatron's default) or both false (--bert-no-binary-head)")
        if labelled and not self.binary_head:
            return ("data.binary_head=true but model.args.binary_head=false: sentence-order labels the model has no "
                    "head for; set data.binary_head=false (--bert-no-binary-head) or model.args.binary_head=true")
        return None


def bert_objective(args: Any) -> BertPretraining:
    """ModelSpec.objective: the args' masked-LM settings (plain data) and binary head."""
    return BertPretraining(masked=masked_lm(args), binary_head=bool(getattr(args, "binary_head", False)))
