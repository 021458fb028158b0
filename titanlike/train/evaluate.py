"""Evaluation during training: the validation loss on held-out data, logged with its perplexity."""
from __future__ import annotations

import torch

from titanlike.data import build_validation_dataloader
from titanlike.train.loss import IGNORE_INDEX


@torch.no_grad()
def validation_loss(trainer) -> float:
    """Mean token loss over validation.steps batches of the held-out data (logged with perplexity)."""
    for part in trainer.model_parts:
        part.eval()
    # validation.split (or validation.paths/dataset) of the data; every pass restarts at its first batch
    loader = trainer.val_loader if trainer.val_loader is not None else build_validation_dataloader(
        trainer.cfg.data, trainer.cfg.validation, trainer.tokenizer, **trainer.val_loader_kw)
    loss_sum = torch.zeros((), device=trainer.device)
    tokens = torch.zeros((), device=trainer.device)
    for _, (inputs, labels) in zip(range(trainer.cfg.validation.steps), loader):
        inputs, labels, kwargs = trainer.batch_layout(inputs.to(trainer.device), labels.to(trainer.device))
        with trainer.amp, trainer._sdpa(), trainer._loss_ctx():
            if trainer.pp is not None:  # forward-only schedule; the loss is summed on the last stage
                loss_sum += trainer.pp.eval_loss(inputs, labels, kwargs)
            else:
                loss_sum += trainer._forward_loss(inputs, labels, kwargs)
        tokens += (labels != IGNORE_INDEX).sum()
    if trainer.pp is not None:
        trainer.pp.reduce_over_pp(loss_sum)
    loss = (trainer._all_reduce_sum(loss_sum) / trainer._all_reduce_sum(tokens)).item()
    trainer.metrics.log_validation(trainer.step, loss)
    for part in trainer.model_parts:
        part.train()
    return loss
