"""Parallelization plans: fn(model, dims: ParallelDims, sections: PlanSections) -> model.

Each technique lives in its own module (fsdp, tp, pp, ac, compile, ...); a model family's plans compose them in
parallelize/<name>.py, whose PLANS dict its ModelSpec names (ModelSpec.plans). `get_plan` picks a plan by name, or
imports a user's "package.module:function". A plan reads only `PlanSections` (parallelize/sections.py: model flavor,
parallelism, training, activation_checkpoint, compile), which the caller builds once from its config. Nothing but
that dataclass is imported until a plan is asked for.
"""

from __future__ import annotations

import importlib
from typing import Callable

from parallelize.sections import PlanSections


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
    import models

    spec = models.MODELS.get(model_name)
    if spec is None:
        raise ValueError(
            f"no parallelization plans registered for model {model_name!r} (models: {sorted(models.MODELS)}); "
            f"pass a 'package.module:function' plan instead"
        )
    plans = importlib.import_module(spec.plans).PLANS
    try:
        return plans[plan_name]
    except KeyError:
        raise ValueError(
            f"unknown plan {plan_name!r} for model {model_name!r}; registered: {sorted(plans)}, "
            f"or give 'package.module:function'"
        ) from None


__all__ = ["PlanSections", "get_plan"]
