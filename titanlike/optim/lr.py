"""LR schedules: linear warmup, then cosine, linear, WSD or constant decay (lr_scheduler section)."""
from __future__ import annotations

import math

import torch

from titanlike.config.sections import LRScheduler


def lr_factor(step: int, total_steps: int, cfg: LRScheduler) -> float:
    """Multiplier on the peak LR for the optimizer step with 0-based index `step`.

    Warmup ramps linearly to 1 over `warmup_steps` (step 0 already gets 1/warmup, never 0, so no step is wasted);
    then cosine / linear decay to `min_lr_factor` at the last step, or WSD: stay at 1 until the final
    `decay_ratio` of the run, then decay linearly.
    """
    warmup = cfg.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    lo = cfg.min_lr_factor
    if cfg.decay_type == "constant":
        return 1.0
    if cfg.decay_type == "wsd":
        decay_steps = max(1, round(cfg.decay_ratio * total_steps))
        decay_start = max(warmup, total_steps - decay_steps)
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / max(1, total_steps - 1 - decay_start))
        return 1.0 - (1.0 - lo) * progress
    progress = min(1.0, (step - warmup) / max(1, total_steps - 1 - warmup))
    if cfg.decay_type == "linear":
        return 1.0 - (1.0 - lo) * progress
    if cfg.decay_type == "cosine":
        return lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"lr_scheduler.decay_type={cfg.decay_type!r}; use cosine, linear, wsd or constant")


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRScheduler, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total_steps, cfg))
