"""Context parallel's ring on the GPU kernel (models.common.masks.attention_lse with "flex": FlexAttention returning
its log-sum-exp and differentiating through it), one process: each rank's partials, merged
(parallelize.cp_ring.merge_partials), equal the rows of whole-sequence attention under the rule, and so do the
gradients summed over the ranks, with grouped KV heads, MLA's narrower values and packed documents, in fp32 and bf16.
The transfers are replaced by indexing (the multi-process runs: tests/multiproc/test_dist_cp.py on gloo, the
trainer on two GPUs: tests/gpu/test_gpu_layouts2.py).

Marked `gpu`; skipped without CUDA."""
import pytest
import torch
import torch.nn.functional as F

from models.common.masks import allowed, attention_lse, build_ring_mask, chunk_positions, document_ids, \
    load_balanced_chunks
from parallelize.cp_ring import merge_partials

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = torch.device("cuda")
S = 1024


def _docs(b):
    gen = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(2, 50, (b, S), device=DEV, generator=gen)
    tokens[tokens % 17 == 0] = 1  # documents of a few dozen tokens, across the 128-token blocks and the CP chunks
    return document_ids(tokens, 1)


def _ring(q, k, v, rank, degree, doc_ids, kernel):
    mask = build_ring_mask(rank, degree, doc_ids, S, kernel, DEV)
    parts = []
    for step in range(degree):
        src = (rank - step) % degree
        block = mask.ring[src]
        kv = chunk_positions(load_balanced_chunks(S, src, degree), DEV)[:block.k1]
        parts.append((block.q0, *attention_lse(q[:, mask.q_index][:, block.q0:], k[:, kv], v[:, kv], block, kernel)))
    return merge_partials(parts, q.dtype), mask.q_index


def _reference(q, k, v, doc_ids):
    ok = allowed(None, doc_ids, S, DEV)
    return F.scaled_dot_product_attention(*(t.double().transpose(1, 2) for t in (q, k, v)), attn_mask=ok,
                                          enable_gqa=True).transpose(1, 2)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n_kv, dv", [(2, 64), (8, 32)], ids=["gqa", "mla_values"])
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "docs"])
@pytest.mark.parametrize("kernel", ["flex", "sdpa"])
def test_ring_partials_merge_to_whole_attention(kernel, documents, n_kv, dv, dtype, tol):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, S, 8, 64, device=DEV, generator=gen)
    k = torch.randn(2, S, n_kv, 64, device=DEV, generator=gen)
    v = torch.randn(2, S, n_kv, dv, device=DEV, generator=gen)
    doc_ids = _docs(2) if documents else None
    dout = torch.randn(2, S, 8, dv, device=DEV, generator=gen)
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    full = _reference(*ref_in, doc_ids)
    ref_grads = torch.autograd.grad(full, ref_in, dout.double())
    for degree in (2, 4):
        ring_in = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v)]
        for rank in range(degree):
            out, idx = _ring(*ring_in, rank, degree, doc_ids, kernel)
            assert out.dtype == dtype
            err = ((out.double() - full[:, idx]).abs().max() / full.abs().max()).item()
            assert err <= tol, (degree, rank, err)
            (out * dout[:, idx].to(dtype)).sum().backward()
        for name, t, ref in zip("qkv", ring_in, ref_grads):
            err = ((t.grad.double() - ref).abs().max() / ref.abs().max()).item()
            assert err <= tol, (degree, f"d{name}", err)
