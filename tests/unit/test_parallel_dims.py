"""ParallelDims: degree resolution, validation messages, properties; the single-process paths (no processes)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from titanlike.config.sections import Parallelism
from titanlike.distributed.init import destroy_distributed, init_distributed
from titanlike.distributed.parallel_dims import ParallelDims


@pytest.mark.parametrize(
    "kw, world, expected_shard",
    [
        ({}, 1, 1),
        ({}, 8, 8),
        ({"dp_replicate": 2}, 8, 4),
        ({"tp": 2, "pp": 2}, 8, 2),
        ({"cp": 2, "tp": 2}, 4, 1),
        ({"dp_shard": 4, "dp_replicate": 2}, 8, 4),
    ],
)
def test_dp_shard_resolution(kw, world, expected_shard):
    dims = ParallelDims(**kw, world_size=world)
    assert dims.dp_shard == expected_shard
    assert dims.dp_replicate * dims.dp_shard * dims.cp * dims.tp * dims.pp == world


def test_properties():
    d = ParallelDims(dp_replicate=2, dp_shard=2, cp=2, tp=2, pp=2, world_size=32)
    assert (d.dp_enabled, d.dp_replicate_enabled, d.dp_shard_enabled, d.fsdp_enabled) == (True, True, True, True)
    assert (d.cp_enabled, d.tp_enabled, d.pp_enabled, d.ep_enabled) == (True, True, True, False)
    assert (d.dp_degree, d.dp_cp_degree, d.non_data_parallel_size) == (4, 8, 8)

    one = ParallelDims(world_size=1)
    assert not any([one.dp_enabled, one.fsdp_enabled, one.tp_enabled, one.pp_enabled, one.cp_enabled])
    assert one.dp_degree == 1

    tp_only = ParallelDims(tp=2, world_size=2)
    assert tp_only.dp_shard == 1 and not tp_only.dp_enabled and not tp_only.fsdp_enabled
    assert ParallelDims(cp=2, world_size=2).fsdp_enabled  # CP ranks shard parameters with FSDP
    assert not ParallelDims(cp=2, world_size=2).dp_enabled  # ... but read the same data
    replicate = ParallelDims(dp_replicate=2, world_size=2)
    assert replicate.fsdp_enabled and replicate.dp_shard == 1 and replicate.dp_degree == 2


def test_world_of_one_needs_no_mesh_or_process_group():
    dims = ParallelDims(world_size=1)
    assert dims.build_mesh("cpu") is None
    assert dims.world_mesh is None and dims.fsdp_mesh is None
    assert dims.get_mesh("dp") is None and dims.get_mesh("tp") is None
    assert dims.dp_rank() == 0
    assert not dist.is_initialized()
    with pytest.raises(KeyError, match="unknown mesh name 'dpp'"):
        dims.get_mesh("dpp")


@pytest.mark.parametrize(
    "kw, world, match",
    [
        # The config's rules and messages (titanlike/config/validate.py:check_degrees): one copy for both.
        ({"dp_shard": 2}, 8, r"dp_shard\*cp\*tp = 1\*1\*2\*1\*1 = 2, but world_size is 8.*dp_shard=-1"),
        ({"dp_replicate": 2, "dp_shard": 2, "tp": 4}, 8, r"= 16, but world_size is 8"),
        ({"tp": 3}, 8, r"parallelism.dp_shard=-1 fills the world, but world_size 8 is not divisible by .* = 3"),
        ({"tp": 0}, 8, r"parallelism.tp=0 must be >= 1"),
        ({"dp_shard": -2}, 8, r"parallelism.dp_shard=-2 must be >= 1, or -1 to fill"),
        ({"pp": 2.0}, 8, r"parallelism.pp=2.0 must be an integer"),
        ({"ep": 3}, 8, r"parallelism.ep=3 must divide parallelism.dp_shard=8"),
        ({}, 0, r"world_size must be a positive int"),
    ],
)
def test_validation_errors(kw, world, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims(**kw, world_size=world)


def test_ep_borrows_ranks_from_dp_shard():
    dims = ParallelDims(ep=4, world_size=8)  # ep does not multiply the world size (its mesh: tests/multiproc/ep_*)
    assert dims.dp_shard == 8 and dims.ep_enabled and dims.dp_degree == 8


def test_from_config():
    cfg = Parallelism(dp_replicate=2, dp_shard=-1, tp=2)
    dims = ParallelDims.from_config(cfg, world_size=8)
    assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, dims.pp, dims.ep) == (2, 2, 1, 2, 1, 1)
    assert cfg.dp_shard == -1  # the config section is not modified


def test_init_distributed_single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert init_distributed("cpu") == (0, 1, 0)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert init_distributed("cuda") == (0, 1, 0)  # no CUDA touched in a world of one
    assert not dist.is_initialized()
    destroy_distributed()  # no-op without a process group
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        init_distributed("cpu")
