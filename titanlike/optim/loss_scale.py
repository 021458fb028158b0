"""fp16 loss scaling, as Megatron-LM's `--fp16` does it (training.mixed_precision_param = "float16", [loss_scaling]).

fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero. The loss is multiplied by a large scale before
backward so the gradients live in fp16's range; the optimizer divides them back (the division is folded into the
clip factor the update already applies, titanlike/optim/adamw.py: no extra pass over the gradients). A step whose
gradients overflowed (a non-finite global grad norm, the same on every rank) is skipped and counts against the
scale:

* dynamic (default): an overflow lowers the hysteresis counter; when it reaches 0 the scale halves (never below
  min_scale). `window` clean steps in a row double the scale and refill the counter. A clean step does not refill
  it: overflows since the last growth add up, as in Megatron's DynamicGradScaler.
* static (static_scale > 0): the scale never changes; overflowing steps are still skipped.

Everything stays on the device (no host sync per step); the counters are read on log steps. The state (scale,
growth and hysteresis counters, skip totals) is checkpointed with the trainer's, so a resumed run continues with the
same scale. On CPU the model computes in fp32, but the scaling and skipping behave the same (tests run there).
"""
from __future__ import annotations

import torch

from titanlike.config.sections import LossScaling


class LossScaler:
    def __init__(self, cfg: LossScaling, device: torch.device):
        self.dynamic = cfg.static_scale <= 0
        self.min_scale = cfg.min_scale
        self.window = cfg.window
        self.hysteresis = cfg.hysteresis
        z = lambda v=0.0: torch.full((), float(v), device=device)  # noqa: E731
        self.scale = z(cfg.initial_scale if self.dynamic else cfg.static_scale)
        self.growth_tracker = z()  # clean steps since the last overflow or growth
        self.hysteresis_tracker = z(cfg.hysteresis)  # overflows left before the scale halves
        self.skipped = z()  # overflowing steps skipped, in total
        self.nan_steps = z()  # steps whose loss was non-finite on this rank, in total
        self._overflow = z()
        self._reported = (0, 0)  # (skipped, nan) at the last log step: Megatron logs per-interval counts

    def overflow(self, scaled_grad_norm: torch.Tensor) -> torch.Tensor:
        """1.0 where the (scaled) global grad norm is not finite, else 0.0; remembered for `update`."""
        self._overflow = (~torch.isfinite(scaled_grad_norm)).float()
        return self._overflow

    @torch.no_grad()
    def update(self, loss_sum: torch.Tensor | None = None) -> None:
        """After the step: count it, and move the scale (dynamic). loss_sum: this rank's summed loss of the step."""
        over = self._overflow
        self.skipped += over
        if loss_sum is not None:
            self.nan_steps += (~torch.isfinite(loss_sum)).float()
        if not self.dynamic:
            return
        clean = 1.0 - over
        hyst = self.hysteresis_tracker - over
        halve = (over > 0) & (hyst <= 0)
        growth = (self.growth_tracker + 1) * clean  # an overflow restarts the window
        grow = growth >= self.window
        self.scale.copy_(torch.where(halve, torch.clamp(self.scale * 0.5, min=self.min_scale),
                                     torch.where(grow, self.scale * 2.0, self.scale)))
        self.growth_tracker.copy_(torch.where(grow, 0.0, growth))
        self.hysteresis_tracker.copy_(torch.where(grow, float(self.hysteresis), torch.clamp(hyst, min=0.0)))

    def at_floor(self) -> torch.Tensor:
        """True on a step that overflowed with nothing left to lower: the scale is static or already min_scale.
        Such steps are what the non-finite guard counts (an fp16 run that keeps overflowing there is broken)."""
        floor = (self.scale <= self.min_scale) if self.dynamic else torch.ones_like(self.scale, dtype=torch.bool)
        return (self._overflow > 0) & floor

    def floor_advice(self) -> str:
        """What to change when steps keep overflowing at the floor (at_floor): the scale's own keys, since a
        smaller learning rate does not make scaled gradients fit in fp16."""
        scale = self.scale.item()
        if not self.dynamic:
            return (f"the gradients overflow fp16 at the static loss scale {scale:g}: lower loss_scaling.static_scale "
                    f"(or set it to 0 for a dynamic scale)")
        return (f"the gradients still overflow fp16 with the dynamic loss scale at its floor, loss_scaling.min_scale "
                f"= {scale:g}: lower loss_scaling.min_scale")

    def log_metrics(self) -> dict[str, float]:
        """Host values for a log step: the scale, and the skipped / NaN-loss steps since the last log step."""
        skipped, nan = int(self.skipped.item()), int(self.nan_steps.item())
        out = {"loss_scale": self.scale.item(), "skipped_iters": skipped - self._reported[0],
               "nan_iters": nan - self._reported[1]}
        self._reported = (skipped, nan)
        return out

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale.item(), "growth_tracker": self.growth_tracker.item(),
                "hysteresis_tracker": self.hysteresis_tracker.item(), "skipped": self.skipped.item(),
                "nan_steps": self.nan_steps.item()}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """A static scale is the config's (a resumed run may change it); the counters always come back."""
        keys = ("growth_tracker", "hysteresis_tracker", "skipped", "nan_steps") + (("scale",) if self.dynamic else ())
        for k in keys:
            if k in state:
                getattr(self, k).fill_(float(state[k]))
        self._reported = (int(self.skipped.item()), int(self.nan_steps.item()))


class SkipAwareLR:
    """The LR scheduler under fp16: a step that overflowed does not advance it, as in Megatron.

    Reading the overflow at the end of its step would make the host wait for the backward every step. Instead the
    flag goes to pinned host memory by a non-blocking copy, and the advance is settled just before the next update
    (`settle`), when that copy has long finished. Whatever reads the schedule (the LR, a checkpoint) settles first,
    so it never sees a pending step."""

    def __init__(self, scheduler, scaler: LossScaler):
        self.scheduler, self.scaler = scheduler, scaler
        device = scaler.scale.device
        self._flag = torch.zeros((), pin_memory=device.type == "cuda")
        self._event = torch.cuda.Event() if device.type == "cuda" else None
        self._pending = False

    def step(self) -> None:
        """After an update (applied or skipped): the advance waits for `settle`."""
        self.settle()
        self._flag.copy_(self.scaler._overflow, non_blocking=True)
        if self._event is not None:
            self._event.record()
        self._pending = True

    def settle(self) -> None:
        if not self._pending:
            return
        if self._event is not None:
            self._event.synchronize()
        self._pending = False
        if not self._flag.item():
            self.scheduler.step()

    def get_last_lr(self):
        self.settle()
        return self.scheduler.get_last_lr()

    def state_dict(self):
        self.settle()
        return self.scheduler.state_dict()

    def load_state_dict(self, state) -> None:
        self._pending = False
        self.scheduler.load_state_dict(state)

    def __getattr__(self, name):  # everything else (optimizer, last_epoch, ...) is the scheduler's
        if name == "scheduler":  # not set yet (copy/unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.scheduler, name)
