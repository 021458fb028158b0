"""Surviving bad steps: the non-finite guard (skip the update, stop after too many in a row) and the loss-spike
detector.

With fused AdamW (the default on CUDA) nothing here adds a per-step host sync: the guard decides on the device
(`found_inf` makes the kernel skip the update) and its counters are read on log steps only.
"""
from __future__ import annotations

import collections
import logging
import math

import torch

from titanlike.optim.container import optimizers_of

logger = logging.getLogger("titanlike")


class NonFiniteError(RuntimeError):
    """`reason` is what went wrong without the advice to stop, for the rollback's own message."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason or message


def skips_on_device(optimizer) -> bool:
    """Whether every optimizer (a PP container's too) skips an update itself where its `found_inf` is 1: fused
    AdamW, or one that declares it (titanlike/optim/master_weights.py). Others need the host to decide."""
    return all(getattr(o, "skips_on_device", False) or all(g.get("fused") for g in o.param_groups)
               for o in optimizers_of(optimizer))


class NonFiniteGuard:
    """Skips every optimizer update whose gradient norm is NaN/Inf.

    The global grad norm is the signal: it is reduced over every data/tensor/pipeline rank, so all ranks agree (a
    NaN loss on one micro-batch of one rank makes the norm NaN everywhere). With fused AdamW the decision stays
    on the device: the kernel reads `optimizer.found_inf` and leaves params, moments and step counts untouched
    where it is 1 - no host sync. Other optimizers (foreach on CPU) decide on the host, one sync per step.
    Counters live on the device; `check()` (log steps only) reports skipped steps and raises once
    `max_consecutive` updates in a row were skipped, naming the first step of that streak.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, max_consecutive: int):
        self.optimizers = optimizers_of(optimizer)  # a PP container holds several
        self.on_device = skips_on_device(optimizer)
        self.max_consecutive = max_consecutive
        z = lambda: torch.zeros((), device=device)  # noqa: E731
        self.skipped, self.consecutive, self.first_bad, self.last_bad = z(), z(), z(), z()
        self.bad_microbatches = z()  # bit i set: micro-batch i of the last bad step had a non-finite local loss
        self.nan_steps = z()  # steps with a non-finite loss on this rank (Megatron's "number of nan iterations")
        self._reported = 0
        self._interval_mark = (0, 0)  # (skipped, nan_steps) at the last interval_counts()
        # fp16: the steps counted here overflowed at the lowest loss scale; with finite losses that is the scale's
        # doing, and this says which keys to change (LossScaler.floor_advice)
        self.scale_advice = None

    def before_optimizer_step(self, step: int, microbatch_losses: list[torch.Tensor],
                              grad_norm: torch.Tensor, bad: torch.Tensor | None = None) -> bool:
        """Records the step; returns False when the host must skip optimizer.step() (host mode only).

        bad: under fp16 loss scaling the scaler skips overflowing steps itself, and only those it can no longer
        answer by lowering the scale count here (LossScaler.at_floor, the same on every rank)."""
        if bad is not None:
            self._record(step, microbatch_losses, bad.float())
            return True
        bad = (~torch.isfinite(grad_norm)).float()
        self._record(step, microbatch_losses, bad)
        if self.on_device:
            for opt in self.optimizers:
                opt.found_inf = bad  # fused AdamW skips the update where this is 1
            return True
        return not bool(bad.item())

    def _record(self, step: int, microbatch_losses: list[torch.Tensor], bad: torch.Tensor) -> None:
        self.skipped += bad
        self.consecutive = (self.consecutive + 1) * bad
        self.first_bad = torch.where(self.consecutive == 1, float(step), self.first_bad)
        self.last_bad = torch.where(bad > 0, float(step), self.last_bad)
        mask = sum(((~torch.isfinite(x)).float() * 2.0**i for i, x in enumerate(microbatch_losses)), bad * 0)
        self.bad_microbatches = torch.where(bad > 0, mask, self.bad_microbatches)
        self.nan_steps += (mask > 0).float()

    def reset(self) -> None:
        """Forget the current streak (after a rollback); the total of skipped updates stays."""
        self.consecutive.zero_()
        self.first_bad.zero_()

    def interval_counts(self) -> dict[str, int]:
        """Skipped updates and steps with a non-finite loss on this rank since the last call (log steps; a host
        sync), as Megatron's log line counts them."""
        now = (int(self.skipped.item()), int(self.nan_steps.item()))
        last, self._interval_mark = self._interval_mark, now
        return {"skipped_iters": now[0] - last[0], "nan_iters": now[1] - last[1]}

    def check(self) -> int:
        """Host-side report on a log step; returns the number of skipped updates so far."""
        skipped, consecutive = int(self.skipped.item()), int(self.consecutive.item())
        mb = int(self.bad_microbatches.item())
        which = [i for i in range(32) if mb >> i & 1]
        if skipped > self._reported:
            logger.warning(f"skipped {skipped - self._reported} update(s) with a non-finite gradient norm; last at "
                           f"step {int(self.last_bad.item())} (non-finite loss on this rank in micro-batch(es) "
                           f"{which if which else 'none'}); {skipped} skipped in total")
            self._reported = skipped
        if self.max_consecutive > 0 and consecutive >= self.max_consecutive:
            reason = (f"{consecutive} consecutive steps had a non-finite loss or gradient norm, the first at step "
                      f"{int(self.first_bad.item())}")
            if self.scale_advice is not None and not which:  # finite losses: the scaled gradients overflowed
                fix = f"{self.scale_advice()}; or resume from the last checkpoint (checkpoint.load_step)"
            else:
                fix = ("lower optimizer.lr, check the data around that step, or resume from the last checkpoint "
                       "(checkpoint.load_step)")
            raise NonFiniteError(f"{reason}; stopping: {fix}", reason=reason)
        return skipped


class SpikeDetector:
    """Flags logged losses more than `zscore` standard deviations above the mean of the last `window` ones."""

    def __init__(self, window: int, zscore: float):
        self.losses: collections.deque[float] = collections.deque(maxlen=window)
        self.zscore = zscore

    def update(self, step: int, loss: float) -> bool:
        spike = False
        if len(self.losses) >= 8 and math.isfinite(loss):
            mean = sum(self.losses) / len(self.losses)
            std = math.sqrt(sum((x - mean) ** 2 for x in self.losses) / len(self.losses))
            spike = std > 0 and (loss - mean) / std > self.zscore
            if spike:
                logger.warning(f"loss spike at step {step}: {loss:.4f} vs mean {mean:.4f} ± {std:.4f} "
                               f"over the last {len(self.losses)} logged steps")
        if math.isfinite(loss):
            self.losses.append(loss)
        return spike
