"""One optimizer per model part (pipeline stages), stepped as one: each (module, optimizer) pair maps parameters
to the full model's FQNs (torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(part, optimizer))."""
from __future__ import annotations

import torch


def run_closure(closure):
    """torch.optim's closure convention, for the optimizers written here: re-evaluate the loss with gradients on,
    before the update."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def optimizers_of(optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers behind `optimizer`: a container's (one per pipeline stage), or the one optimizer itself."""
    return list(getattr(optimizer, "optimizers", [optimizer]))


class OptimizersContainer(torch.optim.Optimizer):
    """Several optimizers (one per stage module) acting as one: step/zero_grad go to each; `param_groups` is the
    concatenation of theirs (the same dicts), so one LR scheduler drives all of them.

    For checkpoints use the pairs: zip(model_parts, container.optimizers) (each maps to the full model's FQNs)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        # Optimizer.__init__ is not called: it would build param groups of its own. These attributes are
        # everything torch.optim.lr_scheduler and our trainer read.
        self.optimizers = list(optimizers)
        self.defaults = self.optimizers[0].defaults
        self.param_groups = [g for opt in self.optimizers for g in opt.param_groups]
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}

    @property
    def state(self):  # read-only merged view (parameters are distinct across parts)
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("OptimizersContainer.step: closures are not supported")
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        raise NotImplementedError("OptimizersContainer: save each optimizer with its model part "
                                  "(get_optimizer_state_dict(part, opt) for part, opt in zip(model_parts, optimizers))")

    def load_state_dict(self, state_dict):
        raise NotImplementedError("OptimizersContainer: load each optimizer with its model part "
                                  "(set_optimizer_state_dict(part, opt, ...))")

    def __repr__(self) -> str:
        return f"OptimizersContainer({len(self.optimizers)} x {type(self.optimizers[0]).__name__})"
