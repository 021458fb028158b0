"""titanlike/distributed/seeded_init.py in one process (the layouts themselves: tests/multiproc/test_dist_init.py).

The same seed gives the same weights and another seed other ones; a parameter's values depend on its FQN, not on
the module it is reached from or the global RNG; a DTensor parameter gets the plain parameter's values without
DTensor's CPU RNG warning; direct `param.normal_()` is routed too; nn.init is restored afterwards.
"""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import models
from titanlike.distributed import seeded_init as si

DTENSOR_RNG_WARNING = "DTensor random operators"


def _llama(seed: int, *, shard_on=None, block_numel=None) -> nn.Module:
    spec = models.get_spec("llama3")
    args = dataclasses.replace(spec.flavor_args("debugmodel"), dim=64, n_heads=4, n_kv_heads=2, n_layers=2,
                               vocab_size=128, max_seq_len=16)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    if shard_on is not None:  # every parameter a DTensor sharded on dim 0 over a mesh of one
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                module.register_parameter(name, nn.Parameter(distribute_tensor(p.detach(), shard_on, [Shard(0)])))
    with torch.no_grad(), si.seeded_init(model, seed, block_numel=block_numel):
        model.init_weights(buffer_device="cpu")
    return model


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


@pytest.fixture
def mesh_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_same_seed_same_weights_other_seed_other_weights():
    torch.manual_seed(1)
    a = _values(_llama(0))
    torch.manual_seed(2)  # the global RNG plays no part
    b = _values(_llama(0))
    c = _values(_llama(1))
    assert all(torch.equal(a[n], b[n]) for n in a)
    random = [n for n in a if not n.endswith("norm.weight")]
    assert random and all(not torch.equal(a[n], c[n]) for n in random)
    assert all(torch.equal(a[n], c[n]) and bool((a[n] == 1).all()) for n in a if n.endswith("norm.weight"))
    # the draws still follow the model's distributions (trunc_normal_ within +-3 std, the embedding N(0, 1))
    assert a["layers.0.attention.wq.weight"].abs().max() <= 0.06 and 0.9 < a["tok_embeddings.weight"].std() < 1.1


def test_values_depend_on_the_fqn_not_the_module_holding_them():
    """A pipeline stage (the whole model's FQNs, other layers deleted) draws what the whole model draws."""
    whole = _values(_llama(0))
    stage = _llama(0)
    del stage.layers["0"]
    stage.tok_embeddings = None
    with torch.no_grad(), si.seeded_init(stage, 0):
        stage.init_weights(buffer_device="cpu")
    got = _values(stage)
    assert got and all(torch.equal(v, whole[n]) for n, v in got.items())


def test_block_size_changes_only_parameters_larger_than_a_block():
    whole, blocked = _values(_llama(0)), _values(_llama(0, block_numel=1024))
    for n, v in whole.items():
        assert torch.equal(v, blocked[n]) == (v.numel() <= 1024 or n.endswith("norm.weight")), n


def test_dtensor_parameters_get_the_plain_values_without_the_cpu_rng_warning(mesh_of_one):
    plain = _values(_llama(0, block_numel=1024))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sharded = _llama(0, shard_on=mesh_of_one, block_numel=1024)
    assert all(isinstance(p, DTensor) for p in sharded.parameters())
    assert not [w for w in caught if DTENSOR_RNG_WARNING in str(w.message)], [str(w.message) for w in caught]
    got = _values(sharded)
    assert all(torch.equal(got[n], plain[n]) for n in plain)
    # without the context, the same init warns (the warning this module removes)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        nn.init.trunc_normal_(sharded.output.weight, std=0.02)
    assert [w for w in caught if DTENSOR_RNG_WARNING in str(w.message)]


def test_direct_random_ops_on_parameters_are_routed_and_others_warn(mesh_of_one):
    lin = nn.Linear(8, 6, bias=False)
    lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh_of_one, [Shard(0)]))
    plain = nn.Linear(8, 6, bias=False)

    def init(module):
        with torch.no_grad(), si.seeded_init(module, 3):
            module.weight.normal_(0.0, 0.5)  # a tensor method, not nn.init: routed by the dispatch mode
        return (module.weight.full_tensor() if isinstance(module.weight, DTensor) else module.weight).clone()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(init(lin), init(plain))
        with torch.no_grad(), si.seeded_init(lin, 3):
            other = distribute_tensor(torch.zeros(4, 2), mesh_of_one, [Shard(0)])
            other.uniform_()  # not a parameter of the module: layout-dependent, said so
    messages = [str(w.message) for w in caught]
    assert any("seeded_init: aten.uniform_" in m for m in messages), messages
    assert sum(DTENSOR_RNG_WARNING in m for m in messages) == 1, messages  # only the unrouted one


def test_out_of_place_random_ops_on_parameters_leave_them_alone():
    lin = nn.Linear(4, 3, bias=False)
    before = lin.weight.detach().clone()
    with torch.no_grad(), si.seeded_init(lin, 0):
        out = torch.normal(lin.weight, 1.0)  # reads the parameter, writes a new tensor: not an init
    assert torch.equal(lin.weight, before) and out.shape == before.shape and not torch.equal(out, before)


def test_nn_init_is_restored_even_after_an_error():
    before = {name: getattr(nn.init, name) for name in si.RANDOM_INITS}
    with pytest.raises(RuntimeError, match="boom"), si.seeded_init(nn.Linear(2, 2), 0):
        assert nn.init.trunc_normal_ is not before["trunc_normal_"]
        raise RuntimeError("boom")
    assert {name: getattr(nn.init, name) for name in si.RANDOM_INITS} == before


def test_shaped_inits_draw_the_whole_tensor_and_keep_their_fans():
    lin = nn.Linear(300, 7, bias=False)
    with torch.no_grad(), si.seeded_init(lin, 0, block_numel=16):
        nn.init.kaiming_uniform_(lin.weight, a=5 ** 0.5)
    bound = 1 / 300 ** 0.5  # fan_in of the whole weight, not of a 16-element block
    assert lin.weight.abs().max() <= bound and lin.weight.abs().max() > 0.9 * bound


def test_draw_seed_is_stable():
    """The values are defined by this function: changing it changes every run's initial weights."""
    assert si.draw_seed(0, "tok_embeddings.weight", 0, 0) == si.draw_seed(0, "tok_embeddings.weight", 0, 0)
    assert si.draw_seed(0, "tok_embeddings.weight", 0, 0) == 7223147804480763391
    assert len({si.draw_seed(s, f, d, b) for s in (0, 1) for f in ("a", "b") for d in (0, 1) for b in (0, 1)}) == 16
