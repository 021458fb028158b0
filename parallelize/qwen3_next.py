"""The Qwen3-Next plans: composed by parallelize/compose.py (TP -> EP -> CP -> AC -> compile -> FSDP) as the other MoE
families', with expert parallelism for the routed experts (parallelize/ep.py); AC, compile and FSDP per block.

Not implemented, refused at config validation by the family's check (models/qwen3_next/__init__.py) with one line
naming parallelism.tp / parallelism.cp: tensor parallelism (the Gated DeltaNet's projections interleave each key
head's q, k, v, z and b, a, so a plan must shard them by key head, and its conv and norm with them) and context
parallelism (the DeltaNet state runs across the whole sequence). The TP dict below is therefore never applied.
"""
from __future__ import annotations

from parallelize.compose import Recipe, compose_plans

from models.qwen3_next import SPEC


def _no_tp_plan(model, **_) -> dict:
    raise ValueError("parallelism.tp > 1: qwen3_next has no tensor-parallel plan yet; set parallelism.tp=1")


# Plan name (model.plan) -> plan; models/qwen3_next's ModelSpec points here.
PLANS = compose_plans(Recipe(SPEC, tp_plan=_no_tp_plan, experts=True))
