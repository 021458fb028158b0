"""The mamba2 plans: parallelize/nemotron_h.py's recipe and TP dict (every block a Mamba-2 mixer; CP by all-to-all
of the heads, parallelize/cp_recurrent.py; EP refused)."""
from __future__ import annotations

from models.mamba2 import SPEC
from parallelize.compose import Recipe, compose_plans
from parallelize.nemotron_h import hybrid_tp_plan

PLANS = compose_plans(Recipe(SPEC, tp_plan=hybrid_tp_plan))
