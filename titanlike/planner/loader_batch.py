"""What the loader hands the objective, as small real tensors for the memory estimate's trace (step.py `_inputs`).

The estimate runs the trainer's own objective and BatchLayout on them, so a family whose data is not plain token
rows must get its loader's layout here (docs/contracts.md "Data"), or the traced step would take another objective
path (BERT's plain masked-LM instead of MLM + sentence order; T5's drawn spans, whose decoder length is not
data.decoder_seq_length). The values only have to be valid ids: memory depends on the shapes, and on how many
targets there are where the loss is per target (the masked share is the data's).
"""
from __future__ import annotations

import torch

from titanlike.train.loss import IGNORE_INDEX


def loader_batch(data, batch: int, seq: int, vocab: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) as the data.dataset's loader yields them for `batch` rows of `seq` tokens."""
    dataset = getattr(data, "dataset", "")
    if dataset == "bert":  # titanlike/data/bert_dataset.py: [B, 3, S] tokens, token types, padding mask
        tokens = torch.randint(0, vocab, (batch, seq), generator=g)
        types = (torch.arange(seq) >= seq // 2).long().expand(batch, seq)
        inputs = torch.stack([tokens, types, torch.ones_like(tokens)], dim=1)
        labels = torch.full((batch, seq + 1), IGNORE_INDEX)
        masked = torch.rand((batch, seq), generator=g) < float(getattr(data, "mask_prob", 0.15))
        labels[:, :seq] = torch.where(masked, tokens, IGNORE_INDEX)
        if getattr(data, "binary_head", False):
            labels[:, seq] = torch.randint(0, 2, (batch,), generator=g)
        return inputs, labels
    if dataset == "t5":  # titanlike/data/t5_dataset.py: [B, 2, Se + Sd] tokens then the padding mask
        sd = int(data.decoder_seq_length)
        tokens = torch.randint(0, vocab, (batch, seq + sd), generator=g)
        inputs = torch.stack([tokens, torch.ones_like(tokens)], dim=1)
        labels = torch.cat([torch.full((batch, seq), IGNORE_INDEX), tokens[:, seq:]], dim=1)  # every decoder target
        return inputs, labels
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)  # plain rows: inputs and next-token labels
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
