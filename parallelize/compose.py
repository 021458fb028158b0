"""The one plan composer. Every family's plans apply the same techniques in the same order:

    TP -> EP -> CP -> AC -> compile -> FSDP

- TP first: it changes the parameter placements that everything after it sees.
- EP next, for the same reason (the routed experts become DTensors on the "ep" axis).
- CP before AC and compile, which trace the attention kernel it installs.
- AC before compile, so the checkpoint is traced into each block's graph.
- compile before FSDP, so FSDP2's hooks run outside the compiled blocks.
- FSDP last: it wraps whatever each block has become.

A family's file (parallelize/<name>.py) gives a `Recipe` — its TP dict and the few steps only it needs — and gets its
PLANS ("default", and "fsdp_only": the data-parallel baseline without TP, AC and compile) from `compose_plans`.
Under PP, parallelize/pp.py splits the model first and calls the plan on each stage (modules a stage lacks are None).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from torch import nn

from parallelize.ac import apply_ac
from parallelize.compile import apply_compile
from parallelize.cp import maybe_cp
from parallelize.ep import maybe_ep
from parallelize.fsdp import maybe_fsdp
from parallelize.mtp import vocab_parallel_mtp
from parallelize.sections import PlanSections
from parallelize.tp import apply_tp, maybe_enable_async_tp

if TYPE_CHECKING:
    from titanlike.config.sections import Compile, Parallelism

ORDER = "TP -> EP -> CP -> AC -> compile -> FSDP"


@dataclass(frozen=True)
class Recipe:
    """What a family's plans need beyond the shared steps.

    tp_plan(model, *, sequence_parallel, loss_parallel, ep_enabled) -> {module path: ParallelStyle}
    experts: the family has routed experts (EP is refused otherwise: there is nothing to shard).
    after_tp(model): run right after TP (e.g. re-tie weights that TP distributed one module at a time).
    fsdp_groups(model) -> (input_modules, output_modules) for FSDP's first and last groups; default the spec's.
    """

    spec: Any
    tp_plan: Callable[..., dict]
    experts: bool = False
    after_tp: Callable[[nn.Module], None] | None = None
    fsdp_groups: Callable[[nn.Module], tuple[tuple[str, ...], tuple[str, ...]]] | None = None

    def groups(self, model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
        if self.fsdp_groups is not None:
            return self.fsdp_groups(model)
        return self.spec.input_modules, self.spec.output_modules


def _refuse_unimplemented(recipe: Recipe, dims, allow: tuple[str, ...]) -> None:
    # Config validation refuses these first; checking here keeps a hand-built ParallelDims honest.
    for name, degree in (("tp", dims.tp), ("pp", dims.pp), ("cp", dims.cp), ("ep", dims.ep)):
        if degree > 1 and name not in allow:
            why = " (it has no routed experts to shard)" if name == "ep" else ""
            raise ValueError(f"parallelism.{name}={degree}: the {recipe.spec.name} plan does not implement "
                             f"{name.upper()}{why}; set parallelism.{name}=1")


def _check(recipe: Recipe, model: nn.Module, dims, flavor: str) -> None:
    problems = recipe.spec.check(model.args, dims, flavor)  # config validation ran it too
    if problems:
        raise ValueError(problems[0])


def _maybe_tp(recipe: Recipe, model: nn.Module, dims, par: Parallelism, compile_cfg: Compile) -> None:
    if not dims.tp_enabled:
        return
    tp_mesh = dims.get_mesh("tp")
    apply_tp(model, tp_mesh, recipe.tp_plan(model, sequence_parallel=par.enable_sequence_parallel,
                                            loss_parallel=par.enable_loss_parallel, ep_enabled=dims.ep > 1))
    vocab_parallel_mtp(model)  # multi-token prediction's losses on the vocabulary-parallel head (parallelize/mtp.py)
    if recipe.after_tp is not None:
        recipe.after_tp(model)
    maybe_enable_async_tp(tp_mesh, par.enable_async_tp,
                          compile_enabled=compile_cfg.enable and "model" in compile_cfg.components)


def compose_plans(recipe: Recipe) -> dict[str, Callable]:
    """PLANS for one family: {"default": TP -> EP -> CP -> AC -> compile -> FSDP, "fsdp_only": EP -> CP -> FSDP}.
    Each plan is fn(model, dims: ParallelDims, sections: PlanSections) -> model."""
    ep = ("ep",) if recipe.experts else ()

    def parallelize_default(model: nn.Module, dims, sections: PlanSections) -> nn.Module:
        _refuse_unimplemented(recipe, dims, allow=("tp", "pp", "cp", *ep))
        _check(recipe, model, dims, sections.flavor)
        _maybe_tp(recipe, model, dims, sections.parallelism, sections.compile)
        maybe_ep(model, dims)
        maybe_cp(model, dims, sections.parallelism.cp_method)
        apply_ac(model, sections.activation_checkpoint)
        apply_compile(model, sections.compile)
        maybe_fsdp(model, dims, sections.parallelism, sections.training, *recipe.groups(model))
        return model

    def parallelize_fsdp_only(model: nn.Module, dims, sections: PlanSections) -> nn.Module:
        if dims.tp_enabled:
            raise ValueError(f"model.plan='fsdp_only' applies FSDP only, but parallelism.tp={dims.tp}; use "
                             f"model.plan='default' ({ORDER}) or set parallelism.tp=1")
        _refuse_unimplemented(recipe, dims, allow=("pp", "cp", *ep))
        _check(recipe, model, dims, sections.flavor)
        maybe_ep(model, dims)
        maybe_cp(model, dims, sections.parallelism.cp_method)
        maybe_fsdp(model, dims, sections.parallelism, sections.training, *recipe.groups(model))
        return model

    name = recipe.spec.name
    parallelize_default.__name__ = parallelize_default.__qualname__ = f"parallelize_{name}"
    parallelize_default.__doc__ = f"The {name} default plan: {ORDER} (parallelize/compose.py)."
    parallelize_fsdp_only.__name__ = parallelize_fsdp_only.__qualname__ = f"parallelize_{name}_fsdp_only"
    parallelize_fsdp_only.__doc__ = (f"The {name} data-parallel baseline: EP -> CP -> FSDP/HSDP, without TP, AC and "
                                     f"compile (for debugging).")
    return {"default": parallelize_default, "fsdp_only": parallelize_fsdp_only}
