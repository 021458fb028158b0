"""The Mixtral parallelization plans: those of parallelize/qwen3.py (TP -> EP -> AC -> compile -> FSDP; MoE blocks
replicated over TP, experts left to parallelize/ep.py), for Llama attention without q/k norms."""
from __future__ import annotations

from models.mixtral import SPEC
from parallelize.qwen3 import make_plans

# Plan name (model.plan) -> plan; models/mixtral's ModelSpec points here.
PLANS = make_plans(SPEC, qk_norm=False)
