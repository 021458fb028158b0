"""titanlike/distributed/seeded_init.py on CUDA (one GPU; the layouts themselves: tests/multiproc/test_dist_init.py).

A sharded rank draws each dim-0 block into a fresh tensor and keeps its rows; one process draws the same blocks in
place, into views of the parameter at any offset: on CUDA too the two must give the same bits (a kernel whose values
depended on the memory's alignment would break layout independence). Marked `gpu`:
`python -m pytest -q tests/gpu/test_gpu_seeded_init.py -m gpu`."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

import models
from titanlike.distributed import seeded_init as si

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("shape, block_numel", [((64, 256), 4096), ((33, 7), 70), ((5, 3, 11), 40)])
@pytest.mark.parametrize("init", ["trunc_normal_", "normal_", "uniform_"])
def test_in_place_draws_equal_fresh_block_draws(shape, block_numel, init):
    lin = nn.Module()
    lin.weight = nn.Parameter(torch.empty(shape, device="cuda"))
    kwargs = {"trunc_normal_": dict(std=0.02, a=-0.06, b=0.06), "normal_": dict(std=0.02), "uniform_": {}}[init]
    with torch.no_grad(), si.seeded_init(lin, 5, block_numel=block_numel):
        getattr(nn.init, init)(lin.weight, **kwargs)
    rows = max(1, block_numel // (lin.weight[0].numel()))
    blocks = []
    for b, r0 in enumerate(range(0, shape[0], rows)):
        block = torch.empty((min(rows, shape[0] - r0), *shape[1:]), device="cuda")
        g = torch.Generator(device="cuda").manual_seed(si.draw_seed(5, "weight", 0, b))
        getattr(nn.init, init)(block, **kwargs, generator=g)
        blocks.append(block)
    assert len(blocks) > 1 and torch.equal(lin.weight.detach(), torch.cat(blocks))


def test_debug_model_same_seed_same_weights_on_cuda():
    spec = models.get_spec("llama3")
    args = dataclasses.replace(spec.flavor_args("debugmodel"), vocab_size=2048, max_seq_len=128)

    def build(seed):
        with torch.device("meta"):
            model = spec.model_cls(args)
        model.to_empty(device="cuda")
        with torch.no_grad(), si.seeded_init(model, seed, block_numel=4096):
            model.init_weights(buffer_device="cuda")
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    a, b, c = build(0), build(0), build(1)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["tok_embeddings.weight"], c["tok_embeddings.weight"])
