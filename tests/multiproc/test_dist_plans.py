"""Plan registry: registered names, a user's "package.module:function", and clear errors."""

from __future__ import annotations

import pytest

from par_helpers import meta_model
from parallelize import PlanSections, get_plan
from parallelize.llama3 import PLANS
from parallelize.ac import is_checkpointed
from titanlike.config.sections import JobConfig
from titanlike.distributed.parallel_dims import ParallelDims

CALLS = []


def my_plan(model, dims, sections):
    """A user's plan, addressed as "<this module>:my_plan"."""
    CALLS.append((dims.world_size, sections.flavor))
    model.user_plan_applied = True
    return model


def test_registered_plans():
    assert get_plan("llama3", "default") is PLANS["default"]
    assert get_plan("llama3", "fsdp_only") is PLANS["fsdp_only"]
    assert set(PLANS) >= {"default", "fsdp_only"}  # the table models/llama3's ModelSpec names


def test_single_process_plans_apply_ac_but_no_fsdp():
    cfg = JobConfig()
    cfg.activation_checkpoint.mode = "full"
    dims = ParallelDims(world_size=1)
    model = get_plan("llama3", "default")(meta_model(), dims, PlanSections.of(cfg))
    assert all(is_checkpointed(b) for b in model.layers.values())
    model = get_plan("llama3", "fsdp_only")(meta_model(), dims, PlanSections.of(cfg))
    assert not any(is_checkpointed(b) for b in model.layers.values())  # fsdp_only ignores AC


def test_user_plan_by_import_path():
    plan = get_plan("llama3", f"{__name__}:my_plan")
    assert plan is my_plan
    model = plan(meta_model(), ParallelDims(world_size=1), PlanSections.of(JobConfig()))
    assert model.user_plan_applied and CALLS[-1] == (1, "debugmodel")
    assert get_plan("some_other_model", f"{__name__}:my_plan") is my_plan  # import paths work for any model


def test_errors():
    with pytest.raises(ValueError, match=r"unknown plan 'nope'.*\['default', 'fsdp_only'\]"):
        get_plan("llama3", "nope")
    with pytest.raises(ValueError, match="no parallelization plans registered for model 'gpt9'"):
        get_plan("gpt9", "default")
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg.mod'"):
        get_plan("llama3", "no_such_pkg.mod:fn")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        get_plan("llama3", f"{__name__}:missing")
    with pytest.raises(ValueError, match="not callable"):
        get_plan("llama3", f"{__name__}:CALLS")
    with pytest.raises(ValueError, match="expected 'package.module:function'"):
        get_plan("llama3", ":fn")


# tp: tests/unit/test_tp.py; pp: plans run per stage (test_dist_pp.py); cp: both plans apply it (test_dist_cp.py)
@pytest.mark.parametrize("plan", ["default", "fsdp_only"])
def test_plans_refuse_expert_parallelism(plan):
    dims = ParallelDims(world_size=2, ep=2, dp_shard=2)
    with pytest.raises(ValueError, match=r"parallelism.ep=2: the llama3 plan does not implement EP"):
        get_plan("llama3", plan)(meta_model(), dims, PlanSections.of(JobConfig()))
