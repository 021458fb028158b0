"""Context-parallel config rules (called from validate.py): the method's name, and what the method needs of the
model's shapes (at load time, and from validate_model with the run's exact args)."""
from __future__ import annotations

import difflib
from typing import Any

from models.common.masks import CP_METHODS
from parallelize.cp_alltoall import head_parts_problem

# Megatron's --cp-comm-type names, which a user coming from it may write here
_MEGATRON_NAMES = {"a2a": "alltoall", "p2p": "ring"}


def check_cp(par, errors: list[str]) -> None:
    """parallelism.cp_method is one of CP_METHODS (Megatron's names pointed at titanlike's)."""
    method = par.cp_method
    if method in CP_METHODS:
        return
    close = _MEGATRON_NAMES.get(method) or next(iter(difflib.get_close_matches(str(method), CP_METHODS, n=1)), None)
    hint = f"; did you mean '{close}'?" if close else ""
    errors.append(f"parallelism.cp_method={method!r} is not one of {', '.join(CP_METHODS)}{hint}")


def check_cp_model(spec, args: Any, par, errors: list[str]) -> None:
    """parallelism.cp_method="alltoall" cuts a TP rank's attention heads into cp parts: cp must divide its query and
    KV heads (ModelShape.heads / kv_heads; a model without attention layers has none to cut). The TP rule on heads
    is the family's own check, which comes first."""
    if par.cp <= 1 or par.cp_method != "alltoall":
        return
    shape = spec.shape(args)
    if not shape.heads or shape.heads % par.tp or shape.kv_heads % par.tp:
        return
    problem = head_parts_problem(shape.heads // par.tp, shape.kv_heads // par.tp, par.cp)
    if problem is not None:
        errors.append(problem)
