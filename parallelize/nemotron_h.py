"""The nemotron_h plans (parallelize/compose.py): AC -> compile -> FSDP per hybrid block, and PP by the spec's
per-layer costs. Refused, with the key to change (the family's check, models/nemotron_h/__init__.py): TP (no plan
splits the Mamba-2 projections by heads and groups yet), CP (the SSM state would pass between ranks along the
sequence) and EP (no experts). parallelize/mamba2.py uses the same recipe."""
from __future__ import annotations

from torch import nn

from models.nemotron_h import SPEC
from parallelize.compose import Recipe, compose_plans


def no_tp_plan(model: nn.Module, **_) -> dict:
    # The spec's check refuses parallelism.tp > 1 before this is reached; kept for a hand-built ParallelDims.
    raise ValueError(f"parallelism.tp: {type(model).__name__} has no tensor-parallel plan yet; set parallelism.tp=1")


PLANS = compose_plans(Recipe(SPEC, tp_plan=no_tp_plan))
