"""What the loader hands the objective, as small real tensors for the memory estimate's trace (step.py `_inputs`).

The estimate runs the trainer's own objective and BatchLayout on them, so a family whose data is not plain token
rows must get its loader's layout here (docs/contracts.md "Data"), or the traced step would take another objective
path (BERT's plain masked-LM instead of MLM + sentence order; T5's drawn spans, whose decoder length is not
data.decoder_seq_length; LLaVA's image slots and placeholder runs). The values only have to be valid ids: memory
depends on the shapes, and on how many targets there are where the loss is per target (the masked share is the
data's).
"""
from __future__ import annotations

import torch

from titanlike.train.loss import IGNORE_INDEX


def loader_batch(data, batch: int, seq: int, vocab: int, g: torch.Generator,
                 model_args=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) as the data.dataset's loader yields them for `batch` rows of `seq` tokens. `model_args`:
    the run's; an image-text family's (images_per_row, pixels, image_tokens, image_token: models/llava) gets its
    own rows."""
    dataset = getattr(data, "dataset", "")
    if all(hasattr(model_args, k) for k in ("images_per_row", "pixels", "image_tokens", "image_token")):
        return _image_text_rows(model_args, batch, seq, g)
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


def _image_text_rows(a, batch: int, seq: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """models/llava/objective.py's rows: images_per_row slots of pixel bytes, then text with a placeholder run for
    every slot (full slots: the tower's and the splice's largest activations), text ids never the image token."""
    head, runs = a.images_per_row * a.pixels, a.images_per_row * a.image_tokens
    if seq <= head + runs:
        raise ValueError(f"training.seq_len={seq}: a llava row holds {head} pixel values and {runs} image tokens; set "
                         f"training.seq_len above {head + runs}")
    rows = torch.randint(0, 256, (batch, seq + 1), generator=g)
    text = torch.randint(0, a.vocab_size - 1, (batch, seq + 1 - head), generator=g)
    text = torch.where(text >= a.image_token, text + 1, text)  # every id but the image token's
    text[:, 1:1 + runs] = a.image_token
    rows[:, head:] = text
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
