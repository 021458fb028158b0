"""float8.moe_experts on CPU (float8/experts.py, models/common/moe_align.py): the token-group padding is exact (the
padded computation equals the unpadded one with the loop path), GroupedExperts hands an aligned layout to a
converter's grouped GEMM, and the config refusals. The benchmark's float8 axis: tests/unit/test_benchmark.py. The
float8 GEMM itself needs CUDA capability >= 9.0: tests/gpu/test_gpu_float8_experts.py."""
from __future__ import annotations

import pytest
import torch

import float8
import float8.experts
from models.common import moe as moe_mod
from models.common.moe import GroupedExperts, MoE, MoEArgs, swiglu_expert_loop
from models.common.moe_align import pad_groups, unpad_groups
from tests.multiproc.par_helpers import meta_model
from titanlike.config import ConfigError
from titanlike.config.load import config_from_dict
from titanlike.config.sections import Float8
from titanlike.config.validate import validate

torch.set_num_threads(1)
ALIGN = float8.experts.ALIGN
# zeros between groups, an expert with exactly 16, groups of 1, and 5 trailing rows (capacity mode's dropped ones)
COUNTS = [[40, 0, 17, 1, 0, 16, 3, 0], [0, 0, 0, 33], [9, 13, 7, 24]]


def _inputs(counts, dim=32, hidden=48, trailing=5, seed=0, exact=False):
    """Expert inputs; exact: small integers in float64 with no gate (squared ReLU), so that every product and sum is
    exact in any order and the padded and unpadded GEMMs (tiled differently) must agree bitwise."""
    gen = torch.Generator().manual_seed(seed)
    e, n = len(counts), sum(counts) + trailing

    def rand(*shape, scale):
        if exact:
            return torch.randint(-3, 4, shape, generator=gen).double()
        return torch.randn(*shape, generator=gen) * scale

    x = rand(n, dim, scale=1.0)
    w1, w3 = (rand(e, hidden, dim, scale=dim**-0.5) for _ in range(2))
    w2 = rand(e, dim, hidden, scale=hidden**-0.5)
    return [x, w1, w2, None if exact else w3], torch.tensor(counts), rand(sum(counts), dim, scale=1.0)


def _run(fn, tensors, counts, g):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves, counts)
    out[: g.shape[0]].backward(g)  # the trailing rows are the caller's padding: no gradient
    return [out] + [t.grad for t in leaves if t is not None]


def _padded_loop(x, w1, w2, w3, counts):
    xp, padded, dest = pad_groups(x, counts, ALIGN)
    return unpad_groups(swiglu_expert_loop(xp, w1, w2, w3, padded), dest)


@pytest.mark.parametrize("counts", COUNTS, ids=["zeros_between", "all_in_last", "unaligned"])
def test_pad_groups_layout(counts):
    (x, *_), c, _ = _inputs(counts)
    xp, padded, dest = pad_groups(x, c, ALIGN)
    rows = -(-x.shape[0] // ALIGN) * ALIGN + ALIGN * len(counts)  # static (no shape depends on the routing), aligned
    assert xp.shape == (rows, x.shape[1])
    assert padded.tolist() == [max(-(-n // ALIGN), 1) * ALIGN for n in counts]  # empty experts get ALIGN zero rows
    starts = torch.cumsum(padded, 0) - padded
    for e, n in enumerate(counts):  # each group at its padded start, zero rows after it up to the multiple of 16
        src = sum(counts[:e])
        assert torch.equal(xp[starts[e]:starts[e] + n], x[src:src + n])
        assert not xp[starts[e] + n:starts[e] + padded[e]].any()
    assert torch.equal(unpad_groups(xp, dest), x)  # the trailing rows come back too, in order
    assert dest.unique().numel() == x.shape[0]


@pytest.mark.parametrize("counts", COUNTS, ids=["zeros_between", "all_in_last", "unaligned"])
def test_padded_experts_equal_unpadded(counts):
    """Forward and every gradient of the padded computation equal the unpadded one (loop path): bitwise where the
    arithmetic is exact (integers in float64), to fp32 rounding with SwiGLU (GEMMs of other row counts tile
    differently)."""
    names = ["out", "grad x", "grad w1", "grad w2", "grad w3"]
    tensors, c, g = _inputs(counts, exact=True)
    for name, a, b in zip(names, _run(_padded_loop, tensors, c, g), _run(swiglu_expert_loop, tensors, c, g)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    tensors, c, g = _inputs(counts)
    for name, a, b in zip(names, _run(_padded_loop, tensors, c, g), _run(swiglu_expert_loop, tensors, c, g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_padding_compiles_fullgraph():
    """Padding and unpadding trace into one graph (no host sync, no data-dependent shape)."""
    tensors, c, _ = _inputs(COUNTS[0], trailing=0)
    compiled = torch.compile(lambda x, counts: pad_groups(x, counts, ALIGN)[0], fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(tensors[0], c), pad_groups(tensors[0], c, ALIGN)[0], rtol=0, atol=0)


def _fake_mm(seen):
    """A grouped GEMM in fp32 that checks what the float8 one requires: groups of multiples of 16, B_t column-major."""
    def mm(x, w_t, offs):
        assert w_t.stride(-2) == 1 and x.stride(-1) == 1
        ends = offs.tolist()
        sizes = [b - a for a, b in zip([0] + ends, ends)]
        assert all(s % ALIGN == 0 for s in sizes), sizes
        seen.append(sizes)
        out, start = x.new_zeros(x.shape[0], w_t.shape[-1]), 0
        for e, end in enumerate(ends):
            out[start:end] = x[start:end] @ w_t[e]
            start = end
        return out
    return mm


def test_grouped_experts_hand_aligned_groups_to_the_hook(monkeypatch):
    """GroupedExperts with a converter's grouped GEMM set (as float8.convert sets it): the GEMM sees 16-aligned
    groups, and the output and gradients match the plain experts."""
    monkeypatch.setattr(moe_mod, "_use_grouped_mm", lambda x, *widths: True)  # the CUDA path, on CPU
    torch.manual_seed(0)
    plain = GroupedExperts(4, 32, 48)
    plain.init_weights(0.02)
    hooked = GroupedExperts(4, 32, 48)
    hooked.load_state_dict(plain.state_dict())
    seen = []
    float8.experts.convert_experts(hooked, mm=_fake_mm(seen))
    assert hooked.group_align == ALIGN and plain.grouped_mm is None
    (x, *_), c, g = _inputs([9, 0, 20, 3], trailing=2)
    outs = []
    for mod in (plain, hooked):
        xi = x.clone().requires_grad_()
        y = mod(xi, c) if mod is hooked else swiglu_expert_loop(xi, mod.w1, mod.w2, mod.w3, c)
        y[: g.shape[0]].backward(g)
        outs.append([y[: g.shape[0]], xi.grad[: g.shape[0]], mod.w1.grad, mod.w2.grad, mod.w3.grad])
    assert seen and seen[0] == [16, 16, 32, 16]  # the empty expert gets 16 zero rows (moe_align.py)
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_experts_problems_and_convert():
    assert "no routed experts" in float8.experts.experts_problems(meta_model())[0]
    with torch.device("meta"):
        odd = MoE(40, MoEArgs(num_experts=4, top_k=2, hidden_dim=24))
        good = MoE(64, MoEArgs(num_experts=4, top_k=2, hidden_dim=32, num_shared_experts=1))
    assert "multiples of 16" in float8.experts.experts_problems(odd)[0]
    assert float8.experts.experts_problems(good) == []
    # float8.convert: experts on the hook, router and shared experts untouched by it
    if float8.experts.device_problem() is None:
        pytest.skip("this host has a float8-capable GPU: the CPU refusal below does not apply")
    with pytest.raises(ValueError, match="float8.moe_experts=true needs a CUDA GPU"):
        float8.convert(good, Float8(enable=True, moe_experts=True))


def _validate(**sections):
    validate(config_from_dict(sections))


def test_config_refusals(monkeypatch):
    moe = {"name": "qwen3", "flavor": "debugmodel_moe"}
    with pytest.raises(ConfigError, match="float8.moe_experts=true needs float8.enable=true"):
        _validate(float8={"moe_experts": True}, model=moe)
    with pytest.raises(ConfigError, match="training.device is \"cpu\": set float8.moe_experts=false"):
        _validate(float8={"enable": True, "moe_experts": True}, model=moe, training={"device": "cpu"})
    if float8.experts.device_problem() is not None:  # a CPU host or an older GPU: refused, naming the key
        with pytest.raises(ConfigError, match="float8.moe_experts=true needs"):
            _validate(float8={"enable": True, "moe_experts": True}, model=moe)
    # the model rules, with the device check passed
    monkeypatch.setattr(float8.experts, "device_problem", lambda: None)
    _validate(float8={"enable": True, "moe_experts": True}, model=moe)
    with pytest.raises(ConfigError, match="no routed experts"):
        _validate(float8={"enable": True, "moe_experts": True})  # the default dense model
    with pytest.raises(ConfigError, match="multiples of 16; .* dim 264"):
        _validate(float8={"enable": True, "moe_experts": True}, model={**moe, "args": {"dim": 264}})

