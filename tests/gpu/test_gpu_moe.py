"""The MoE layer's CUDA path (models/common/moe.py): torch._grouped_mm in bf16 against the per-expert loop fallback,
forward and backward, with experts that receive no tokens; no host sync in a forward + backward; compiled = eager.

Marked `gpu`; skipped without CUDA capability >= 9.0 (the grouped GEMM's fast kernel). Run on the GPU machine with
`python -m pytest -q tests/gpu/test_gpu_moe.py`.

Tolerance: both paths compute in bf16 with fp32 accumulation but in different orders and tilings, and the SwiGLU
rounds its bf16 intermediates, so they agree to bf16 precision, not bitwise: we require the error's norm to be within
2% of the reference's norm (measured against an fp32 loop, which both must also meet).
"""
from __future__ import annotations

import copy

import pytest
import torch

from models.common.moe import MoE, MoEArgs, swiglu_expert_loop, swiglu_grouped_mm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                       reason="needs CUDA capability >= 9.0 (torch._grouped_mm's bf16 kernel)"),
]

REL_TOL = 2e-2


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = (got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)
    assert err < REL_TOL, f"{what}: relative error {err:.3e} > {REL_TOL}"


def _expert_inputs(counts, dim=256, hidden=128, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    e = len(counts)
    n = sum(counts) + 5  # 5 padding rows past the last expert's, as capacity mode leaves them
    x = torch.randn(n, dim, device="cuda", generator=gen)
    w1 = torch.randn(e, hidden, dim, device="cuda", generator=gen) * dim**-0.5
    w3 = torch.randn(e, hidden, dim, device="cuda", generator=gen) * dim**-0.5
    w2 = torch.randn(e, dim, hidden, device="cuda", generator=gen) * hidden**-0.5
    g = torch.randn(sum(counts), dim, device="cuda", generator=gen)
    return [x, w1, w2, w3], torch.tensor(counts, device="cuda"), g


def _run(fn, tensors, counts, g, dtype):
    leaves = [t.detach().to(dtype).clone().requires_grad_() for t in tensors]
    out = fn(*leaves, counts)[: g.shape[0]]  # padding rows are unspecified on the grouped path
    out.backward(g.to(dtype))
    return [out] + [leaves[0].grad[: g.shape[0]]] + [t.grad for t in leaves[1:]]


@pytest.mark.parametrize("counts", [[40, 0, 17, 1, 0, 70, 3, 0], [0, 0, 0, 64], [9, 13, 7, 24]],
                         ids=["zeros_between", "all_in_last", "unaligned_groups"])
def test_grouped_mm_matches_loop_bf16(counts):
    tensors, c, g = _expert_inputs(counts)
    ref = _run(swiglu_expert_loop, tensors, c, g, torch.float32)
    gmm = _run(swiglu_grouped_mm, tensors, c, g, torch.bfloat16)
    loop = _run(swiglu_expert_loop, tensors, c, g, torch.bfloat16)
    for name, a, b, r in zip(["out", "grad x", "grad w1", "grad w2", "grad w3"], gmm, loop, ref):
        _close(a, b, f"{name} grouped_mm vs loop (bf16)")
        _close(a, r, f"{name} grouped_mm vs fp32")
    for i, n in enumerate(counts):
        if n == 0:  # an expert with no tokens: exactly zero gradient, not stale memory
            for w in gmm[2:]:
                assert not w[i].any(), f"expert {i} has no tokens but a nonzero gradient"


def _with_params(m: MoE, dtype: torch.dtype) -> MoE:
    # Parameters only, as FSDP's mixed precision or master_weights.py hold them: Module.to(dtype) would also cast
    # the fp32 buffers (expert_bias, tokens_per_expert), which must stay fp32.
    for p in m.parameters():
        p.data = p.data.to(dtype)
    return m


def _moe(**kw) -> MoE:
    torch.manual_seed(0)
    m = MoE(256, MoEArgs(num_experts=8, top_k=2, hidden_dim=128, num_shared_experts=1, **kw)).cuda()
    m.init_weights(0.02)
    return _with_params(m, torch.bfloat16)


@pytest.mark.parametrize("kw", [dict(aux_loss_coeff=0.01, z_loss_coeff=1e-3),
                                dict(capacity_factor=1.0, seq_aux_loss_coeff=0.01, score_func="sigmoid",
                                     n_groups=4, topk_groups=2, route_norm=True)],
                         ids=["dropless", "capacity_grouped"])
def test_moe_step_has_no_host_sync(kw):
    m = _moe(**kw)
    x = torch.randn(4, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    m(x).sum().backward()  # warm-up: lazy inits may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        m(x).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(x.grad).all()


def test_moe_bf16_grouped_matches_fp32_loop_and_compile():
    m = _moe(aux_loss_coeff=0.01)
    # fp32 on CUDA takes the loop fallback. Same bf16-valued weights and input: the router (fp32 in both) then picks
    # the same experts, so the comparison measures the expert arithmetic, not routing flips at near-ties.
    ref = _with_params(copy.deepcopy(m), torch.float32)
    comp = copy.deepcopy(m)
    comp.compile(fullgraph=True)
    x = torch.randn(2, 64, 256, device="cuda").to(torch.bfloat16)
    outs = []
    for mod, dtype in ((m, torch.bfloat16), (ref, torch.float32), (comp, torch.bfloat16)):
        xi = x.detach().to(dtype).clone().requires_grad_()
        y = mod(xi)
        y.float().square().mean().backward()
        outs.append((y, xi.grad, mod.router.gate.weight.grad, mod.experts.w1.grad))
    for name, a, r, c in zip(["out", "grad x", "grad gate", "grad w1"], *outs):
        _close(a, r, f"{name} bf16 grouped vs fp32 loop")
        _close(c, a, f"{name} compiled vs eager")
