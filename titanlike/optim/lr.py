"""LR schedules: linear warmup, then cosine, linear, WSD or constant decay (lr_scheduler section)."""
from __future__ import annotations

import logging
import math

import torch

from titanlike.config.sections import LRScheduler

logger = logging.getLogger("titanlike")


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


class ScheduleLR(torch.optim.lr_scheduler.LambdaLR):
    """lr_factor over `total_steps`, which it saves with its state: a run resumed with another training.steps either
    stretches the schedule over the new total (lr_scheduler.on_steps_change="stretch"; the LR at the resumed step
    then differs from the saved run's) or keeps the saved run's shape ("keep"; steps past its end stay at its final
    LR). Either way a warning says what happened and names the key."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: LRScheduler, total_steps: int):
        self.cfg, self.planned, self.total_steps = cfg, total_steps, total_steps  # planned: this run's training.steps
        super().__init__(optimizer, lambda s: lr_factor(s, self.total_steps, self.cfg))

    def state_dict(self) -> dict:
        return {k: v for k, v in super().state_dict().items() if k not in ("cfg", "planned")}

    def load_state_dict(self, state: dict) -> None:
        state = {k: v for k, v in state.items() if k not in ("cfg", "planned")}
        saved = state.pop("total_steps", None)  # None: saved before the total was kept
        super().load_state_dict(state)
        self.total_steps = self.planned
        if saved is None or saved == self.planned:
            return
        step, lr, cfg = self.last_epoch, self.base_lrs[0], self.cfg
        old, new = lr * lr_factor(step, saved, cfg), lr * lr_factor(step, self.planned, cfg)
        if cfg.on_steps_change == "keep":
            self.total_steps = saved
        # The optimizer's state (loaded first) holds the LR the saved schedule set for the next step: set this one's.
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            value = base * lr_factor(step, self.total_steps, cfg)
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(value)
            else:
                group["lr"] = value
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]
        if cfg.on_steps_change == "keep":
            logger.warning(f"LR schedule: the checkpoint's run planned {saved} steps, this one {self.planned}; keeping "
                           f"the saved schedule's shape (the next step's LR is {old:.3g}; steps past {saved} stay at "
                           f"{lr * lr_factor(saved - 1, saved, cfg):.3g}); lr_scheduler.on_steps_change=\"stretch\" "
                           f"stretches it over {self.planned} steps instead")
        else:
            logger.warning(f"LR schedule: the checkpoint's run planned {saved} steps, this one {self.planned}; the "
                           f"schedule is stretched over {self.planned} steps, so the next step's LR is {new:.3g} "
                           f"where the saved schedule gives {old:.3g}; set lr_scheduler.on_steps_change=\"keep\" to "
                           f"continue the saved schedule's shape instead")


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRScheduler, total_steps: int) -> ScheduleLR:
    return ScheduleLR(optimizer, cfg, total_steps)
