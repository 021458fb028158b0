"""titanlike/train/loss.py: the chunked LM head + cross-entropy equals the plain path (fp32: loss and gradients within
1e-5), through the model and the Trainer; the FSDP2 case is in tests/multiproc/test_dist_float8.py."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import float8
from tests.multiproc.par_helpers import global_batch, reference_model
from titanlike.config import ConfigError
from titanlike.config.load import config_from_dict
from titanlike.config.sections import JobConfig
from titanlike.config.validate import validate
from titanlike.train.loss import ChunkedLossLinear, apply_chunked_loss, chunked_linear_cross_entropy, loss_targets

torch.set_num_threads(1)


def plain_sum(h, w, labels):
    return F.cross_entropy((h @ w.t()).flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=-100)


@pytest.mark.parametrize("chunk", [1, 7, 16, 74, 1000])  # 74 tokens: ragged, exact, one chunk, bigger than all
def test_matches_plain_loss_and_grads(chunk):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 37, 64, generator=g, requires_grad=True)
    w = (0.3 * torch.randn(200, 64, generator=g)).requires_grad_()
    labels = torch.randint(0, 200, (2, 37), generator=g)
    labels[0, :5] = -100  # ignored positions (padding, document masks)
    n = (labels != -100).sum()
    ref = plain_sum(h, w, labels)
    gh, gw = torch.autograd.grad(ref / n * 0.7, (h, w))
    out = chunked_linear_cross_entropy(h, w, labels, chunk)
    ch, cw = torch.autograd.grad(out / n * 0.7, (h, w))
    assert out.dtype == torch.float32
    assert abs(out.item() - ref.item()) / n <= 1e-5
    torch.testing.assert_close(ch, gh, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cw, gw, atol=1e-5, rtol=1e-5)
    assert ch[0, :5].abs().max() == 0  # ignored rows get no gradient
    with torch.no_grad():  # evaluation: no gradients computed or kept
        assert chunked_linear_cross_entropy(h, w, labels, chunk).item() == pytest.approx(out.item(), rel=1e-6)


def test_autocast_bf16_follows_linear():
    """Under autocast the head computes in bf16 like nn.Linear would; fp32 weights get fp32 gradients."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(64, 64, generator=g, requires_grad=True)
    w = (0.3 * torch.randn(128, 64, generator=g)).requires_grad_()
    labels = torch.randint(0, 128, (64,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(F.linear(h, w).float(), labels, reduction="sum")
        out = chunked_linear_cross_entropy(h, w, labels, 16)
    out.backward()
    assert w.grad.dtype == torch.float32 and h.grad.dtype == torch.float32
    assert out.item() == pytest.approx(ref.item(), rel=1e-2)


def test_model_head_swap_keeps_fqns_and_matches():
    ref = reference_model(0)
    model = copy.deepcopy(ref)
    head = apply_chunked_loss(model, chunk_tokens=24)
    assert isinstance(model.output, ChunkedLossLinear) and head is model.output
    assert list(model.state_dict()) == list(ref.state_dict())
    inputs, labels = global_batch(0, 3)
    torch.testing.assert_close(model(inputs), ref(inputs))  # outside loss_targets: plain logits
    ref_loss = F.cross_entropy(ref(inputs).flatten(0, 1), labels.flatten(), reduction="sum")
    ref_loss.backward()
    with loss_targets(head, labels):
        loss = model(inputs)
    loss.backward()
    assert head._labels is None
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-5, rtol=1e-5, msg=name)


def test_refuses_float8_head_and_tp():
    model = reference_model(0)
    cfg = JobConfig().float8
    cfg.enable, cfg.filter_fqns = True, []
    float8.convert(model, cfg)
    with pytest.raises(ValueError, match="filter_fqns"):
        apply_chunked_loss(model, 16)
    with pytest.raises(ConfigError, match="loss_chunk_tokens"):
        validate(config_from_dict({"training": {"loss_chunk_tokens": 16}, "parallelism": {"tp": 2}}))


def test_trainer_chunked_loss_equals_plain(tmp_path):
    from titanlike.train.trainer import Trainer

    def run(chunk):
        cfg = config_from_dict({
            "job": {"dump_folder": str(tmp_path)}, "model": {"flavor": "debugmodel", "vocab_size": 256},
            "training": {"steps": 3, "seq_len": 32, "local_batch_size": 2, "device": "cpu", "loss_chunk_tokens": chunk},
            "data": {"dataset": "mock"}, "lr_scheduler": {"warmup_steps": 1},
            "metrics": {"log_freq": 1, "enable_tensorboard": False}})
        trainer = Trainer(cfg)
        try:
            return [(h["loss"], h["grad_norm"]) for h in trainer.train()]
        finally:
            trainer.close()

    for (a, ga), (b, gb) in zip(run(0), run(20)):
        assert a == pytest.approx(b, abs=1e-5) and ga == pytest.approx(gb, rel=1e-4)
