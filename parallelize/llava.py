"""The LLaVA plans, composed by parallelize/compose.py: FSDP (and AC / compile of the decoder blocks) through the
generic composer; TP, PP, CP and EP are refused by the family's check in one line.

FSDP groups: each tower block on its own (a ViT-L tower is 300M parameters: one group would stay unsharded through
its whole forward), then the spec's groups: tok_embeddings, the rest of the tower (patch embedding), the projector,
each decoder block, norm + output."""
from __future__ import annotations

from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from models.llava import SPEC
from parallelize.compose import Recipe, compose_plans
from parallelize.fsdp import fsdp_dtypes, resolve_reshard_after_forward


def _no_tp(model, **_):
    raise ValueError("parallelism.tp: llava has no TP plan yet; set parallelism.tp=1")


def _shard_tower_blocks(plan):
    def parallelize(model, dims, sections):
        if dims.fsdp_enabled and not dims.tp_enabled:  # tp: the plan refuses it below, in one line
            param_dtype, reduce_dtype = fsdp_dtypes(dims, sections.training)
            reshard = resolve_reshard_after_forward(sections.parallelism.fsdp_reshard_after_forward, dims.pp_enabled)
            for block in model.vision.layers.values():
                fully_shard(block, mesh=dims.fsdp_mesh, reshard_after_forward=reshard,
                            mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype))
        return plan(model, dims, sections)

    parallelize.__name__, parallelize.__doc__ = plan.__name__, plan.__doc__
    return parallelize


PLANS = {name: _shard_tower_blocks(plan) for name, plan in compose_plans(Recipe(SPEC, tp_plan=_no_tp)).items()}
