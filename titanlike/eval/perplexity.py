"""Perplexity of a model on any dataset titanlike reads (Megatron .bin/.idx, text/JSONL/Parquet, the embedded
default), with the trainer's data pipeline: the same batches the training loop's validation scores.

scripts/evaluate.py --perplexity loads a checkpoint (titanlike.infer.load_for_inference) and calls `perplexity` on
`build_validation_dataloader(data, validation, ...)`. During training the [validation] section (and the [eval]
section's perplexity sets) compute the same number with the trainer's parallel layout (titanlike/train/evaluate.py).
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from titanlike.eval.scoring import full_logits


@torch.no_grad()
def perplexity(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], steps: int, *,
               device: torch.device | str, context: Callable[[], contextlib.AbstractContextManager] | None = None,
               progress: bool = True) -> dict[str, float]:
    """{"loss": mean token loss, "perplexity": exp(loss), "tokens": tokens scored} over `steps` batches of
    (input_ids, labels). Labels of -100 (cross_entropy's default ignore_index, titanlike's IGNORE_INDEX: document
    ends under data.eod_mask_loss) are not scored."""
    context = context or contextlib.nullcontext
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    tokens = 0
    it = zip(range(steps), batches)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, total=steps, desc="perplexity", unit="batch")
    for _, (inputs, labels) in it:
        inputs, labels = inputs.to(device), labels.to(device)
        with context():
            logits = full_logits(model(inputs))
        loss_sum += F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").double()
        tokens += int((labels != -100).sum())
    loss = loss_sum.item() / max(tokens, 1)
    return {"loss": loss, "perplexity": math.exp(min(loss, 700)), "tokens": tokens}
