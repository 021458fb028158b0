"""The GPU kernels of masked attention (models/common/masks.py) held equal to the rule the CPU tests check:

- "flex" (FlexAttention, compiled) for packed documents, and for context parallel's local queries over the whole
  sequence, against SDPA with the dense boolean mask of `allowed` (fp32 math, so the reference is exact);
- "sdpa" lower-right causal runs (context parallel without documents: flash / cuDNN / efficient through torch's
  CausalBias) against the rows of full causal attention;
- a compiled training run with document masking on FlexAttention learns, and compiled blocks are not recompiled as the
  documents change from batch to batch.

Marked `gpu`; skipped without CUDA."""
import pytest
import torch
import torch.nn.functional as F

from models.common.masks import allowed, build_mask, document_ids, load_balanced_chunks, masked_attention
from tests.gpu.test_gpu_train import _debug_cfg
from titanlike.train.trainer import Trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = torch.device("cuda")


def _qkv(s, hq=8, hkv=2, d=64, b=2, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(b, s, h, d, device=DEV, dtype=dtype, generator=gen).requires_grad_() for h in (hq, hkv, hkv)]


def _docs(b, s, eod=1):
    gen = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(2, 50, (b, s), device=DEV, generator=gen)
    tokens[tokens % 17 == 0] = eod  # documents of a few dozen tokens, crossing the 128-token blocks
    return document_ids(tokens, eod)


def _reference(q, k, v, q_index, doc_ids, dtype=torch.float32):
    """SDPA with the dense mask of the rule (in `dtype`), queries taken at q_index."""
    ok = allowed(q_index, doc_ids, k.shape[1], DEV)
    out = F.scaled_dot_product_attention(*(t.to(dtype).transpose(1, 2) for t in (q, k, v)), attn_mask=ok,
                                         enable_gqa=True)
    return out.transpose(1, 2)


def _rel_err(a, ref):
    return ((a.float() - ref).abs().max() / ref.abs().max()).item()


def _grads(out, inputs, dout):
    return (out, *torch.autograd.grad(out, inputs, dout))


@pytest.mark.parametrize("cp", [1, 2, 4], ids=lambda c: f"cp{c}")
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "docs"])
@pytest.mark.parametrize("kernel", ["flex", "sdpa"])
def test_masked_kernels_match_the_rule(kernel, documents, cp):
    if kernel == "sdpa" and documents:
        pytest.skip("the dense-mask path is the reference itself")
    s = 1024
    q, k, v = _qkv(s)
    doc_ids = _docs(2, s) if documents else None
    for rank in range(cp):
        chunks = load_balanced_chunks(s, rank, cp) if cp > 1 else None
        mask = build_mask(chunks, doc_ids, s, kernel, DEV)
        qi = mask.q_index
        q_local = q if qi is None else q[:, qi].detach().requires_grad_()
        dout = torch.randn_like(q_local)
        got = _grads(masked_attention(q_local, k, v, mask), (q_local, k, v), dout)
        ref = _grads(_reference(q_local, k, v, qi, doc_ids), (q_local, k, v), dout.float())
        # bf16 rounding: the kernel may be as far from the fp32 rule as the same dense SDPA computed in bf16 (x2)
        ref_bf16 = _grads(_reference(q_local, k, v, qi, doc_ids, torch.bfloat16), (q_local, k, v), dout)
        for name, a, b, c in zip(("out", "dq", "dk", "dv"), got, ref, ref_bf16):
            err, budget = _rel_err(a, b), max(2 * _rel_err(c, b), 1e-2)
            assert err <= budget, (f"rank {rank} {name}", err, budget)


def test_document_masking_run_learns_without_recompiling(tmp_path):
    """The debug model, compiled per block, packed documents on FlexAttention: the loss falls and dynamo compiles
    each block once, not once per batch of documents."""
    from torch._dynamo.utils import counters

    counters.clear()
    trainer = Trainer(_debug_cfg(tmp_path, "--compile.enable", "--data.document_masking=true",
                                 "--activation_checkpoint.mode=selective",  # compiled flex inside checkpointed blocks
                                 "--activation_checkpoint.selective_option=op",
                                 "--data.reset_position_ids=true", "--training.seq_len=1024",
                                 "--training.local_batch_size=4"))
    try:
        assert trainer.model_parts[0].mask_kernel == "flex"
        hist = trainer.train()
    finally:
        trainer.close()
    assert hist[-1]["loss"] < hist[0]["loss"] - 1.0, hist
    frames = counters["stats"]["unique_graphs"]
    assert frames <= 4 * len(trainer.model.layers), dict(counters["stats"])
