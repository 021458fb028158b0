"""The hybrid models' sequence mixers (models/common/mamba2.py, gated_deltanet.py) under Inductor on a GPU: the
compiled chunked forward and backward, packed documents and the returned state included, equal eager (the unit tests
compile with aot_eager only: Inductor's CPU build of these graphs takes minutes). Marked `gpu`; run on the GPU
machine: `python -m pytest -q tests/gpu/test_gpu_mixers.py -m gpu`."""
import pytest
import torch

from models.common.gated_deltanet import GatedDeltaNet
from models.common.mamba2 import Mamba2Mixer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DIM, SEQ = 256, 320  # five chunks of 64


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "mamba2":
        m = Mamba2Mixer(DIM, n_heads=8, head_dim=32, state_size=64, n_groups=2)
    else:
        m = GatedDeltaNet(DIM, n_k_heads=2, n_v_heads=4, head_k_dim=64, head_v_dim=64)
    m = m.cuda()
    with torch.no_grad():
        m.init_weights(0.02)
    return m


@pytest.mark.parametrize("name", ["mamba2", "deltanet"])
def test_inductor_equals_eager(name):
    m = build(name)
    x = torch.randn(2, SEQ, DIM, device="cuda", requires_grad=True)
    docs = torch.cat([torch.zeros(2, 100), torch.ones(2, 3), torch.full((2, SEQ - 103), 2.0)], dim=1).long().cuda()
    cot = torch.randn(2, SEQ, DIM, device="cuda")
    results = []
    for fn in (m, torch.compile(m, fullgraph=True)):
        out, state = fn(x, doc_ids=docs, return_state=True)
        (out * cot).sum().backward()
        results.append((out.detach(), state.recurrent, {n: p.grad.clone() for n, p in m.named_parameters()},
                        x.grad.clone()))
        m.zero_grad()
        x.grad = None
    (out_e, st_e, g_e, xg_e), (out_c, st_c, g_c, xg_c) = results
    # TF32 matmuls may differ between the eager and Inductor kernels: a relative 1e-3 of each tensor's largest entry.
    for a, b in [(out_c, out_e), (st_c, st_e), (xg_c, xg_e)] + [(g_c[k], g_e[k]) for k in g_e]:
        assert (a - b).abs().max() <= 1e-3 * max(1.0, b.abs().max().item())
