"""FlashAttention-4 as the model's attention (models/common/fa4.py, model.attn_backend = "fa4"): the custom ops
match cuDNN's SDPA forward and backward, eager and compiled, and a run on them learns.

Marked `gpu`; skipped without CUDA or without the flash-attn-4 package (`pip install 'titanlike[fa4]'`)."""
import pytest
import torch

from tests.gpu.test_gpu_train import _debug_cfg
from titanlike.train.trainer import Trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module", autouse=True)
def _needs_fa4():
    from models.common.fa4 import fa4_unavailable

    reason = fa4_unavailable(torch.device("cuda"))
    if reason:
        pytest.skip(reason)


def _matches_cudnn(fa4, sdpa, compiled, q, k, v, dout):
    """FA4's kernel (eager or compiled) against the same contract on cuDNN's SDPA: output and the three gradients."""
    from models.common.backends import sdpa_context

    fa4 = torch.compile(fa4, fullgraph=True) if compiled else fa4
    out = fa4(q, k, v)
    got = (out, *torch.autograd.grad(out, (q, k, v), dout))
    with sdpa_context("cudnn", q.device)():
        ref_out = sdpa(q, k, v)
        ref = (ref_out, *torch.autograd.grad(ref_out, (q, k, v), dout))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fa4_matches_cudnn_sdpa(compiled, head_dim):
    from models.common.attention import causal_attention
    from models.common.fa4 import fa4_causal_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 1024, h, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for h in (8, 2, 2))
    dout = torch.randn(2, 1024, 8, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    _matches_cudnn(fa4_causal_attention, causal_attention, compiled, q, k, v, dout)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("seqlen,head_dim", [(512, 64), (197, 64), (577, 128)])
def test_bidirectional_fa4_matches_cudnn_sdpa(compiled, seqlen, head_dim):
    """The encoders' kernel (BERT at 512, ViT-L/16 at 197 tokens, a 336-pixel tower at 577), not causal."""
    from models.common.encoder import bidirectional_attention
    from models.common.fa4 import fa4_bidirectional_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(4, seqlen, 16, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
               .requires_grad_() for _ in range(3))
    dout = torch.randn(4, seqlen, 16, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    _matches_cudnn(fa4_bidirectional_attention, bidirectional_attention, compiled, q, k, v, dout)


def test_bert_on_fa4_learns(tmp_path):
    """A compiled BERT (head dim 64) on FA4: every block's kernel is FA4's, and the MLM loss falls."""
    from models.common.fa4 import fa4_bidirectional_attention
    from tests.launch import REPO_ROOT
    from titanlike.config.load import load_config

    # The debug flavor at dim 128 over 2 heads: head dim 64, which FA4 takes.
    cfg = load_config(["--config", str(REPO_ROOT / "configs/bert_debug.toml"), f"--job.dump_folder={tmp_path}",
                       "--training.device=cuda", "--metrics.log_freq=10", "--training.steps=40",
                       "--model.args={dim = 128, n_heads = 2}", "--model.attn_backend=fa4", "--compile.enable"])
    trainer = Trainer(cfg)
    try:
        assert all(layer.attention.bidirectional_fn is fa4_bidirectional_attention
                   for layer in trainer.model.layers.values())
        hist = trainer.train()
    finally:
        trainer.close()
    assert hist[-1]["loss"] < hist[0]["loss"] - 0.5, hist


def test_run_on_fa4_learns(tmp_path):
    """The 1B block shape (head dim 64), two blocks, compiled, on FA4: the loss falls."""
    trainer = Trainer(_debug_cfg(tmp_path, "--model.flavor=1B", "--model.n_layers=2", "--model.attn_backend=fa4",
                                 "--compile.enable", "--training.seq_len=512", "--training.local_batch_size=4"))
    try:
        from models.common.fa4 import fa4_causal_attention

        assert all(layer.attention.attention_fn is fa4_causal_attention for layer in trainer.model.layers.values())
        hist = trainer.train()
    finally:
        trainer.close()
    assert hist[-1]["loss"] < hist[0]["loss"] - 1.0, hist
