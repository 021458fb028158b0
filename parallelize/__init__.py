"""Parallelization plans: fn(model, dims: ParallelDims, cfg: JobConfig) -> model.

Each technique lives in its own module (fsdp, ac, compile, ...); a model's plans compose them.
`get_plan` picks a registered plan by name, or imports a user's "package.module:function".
"""

from __future__ import annotations

import importlib
from typing import Callable

from parallelize.llama3 import parallelize_llama, parallelize_llama_fsdp_only

PLANS: dict[str, dict[str, Callable]] = {
    "llama3": {"default": parallelize_llama, "fsdp_only": parallelize_llama_fsdp_only},
}


def _import_plan(ref: str) -> Callable:
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise ValueError(f"plan {ref!r}: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"plan {ref!r}: cannot import module {module_name!r}: {e}") from e
    fn = module
    for part in attr.split("."):  # allow "pkg.mod:Class.method"
        try:
            fn = getattr(fn, part)
        except AttributeError:
            raise ValueError(f"plan {ref!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not callable(fn):
        raise ValueError(f"plan {ref!r}: {attr!r} is not callable")
    return fn


def get_plan(model_name: str, plan_name: str) -> Callable:
    """Return the plan function for `model_name`: a registered name ("default", "fsdp_only", ...) or
    "package.module:function" (imported; works for any model)."""
    if ":" in plan_name:
        return _import_plan(plan_name)
    plans = PLANS.get(model_name)
    if plans is None:
        raise ValueError(
            f"no parallelization plans registered for model {model_name!r} (models with plans: {sorted(PLANS)}); "
            f"pass a 'package.module:function' plan instead"
        )
    try:
        return plans[plan_name]
    except KeyError:
        raise ValueError(
            f"unknown plan {plan_name!r} for model {model_name!r}; registered: {sorted(plans)}, "
            f"or give 'package.module:function'"
        ) from None


__all__ = ["PLANS", "get_plan"]
