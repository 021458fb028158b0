"""float8/ on CPU (torch 2.13 runs `_scaled_mm` on CPU): which modules convert, the filter rules, compute-only state
dicts (a float8 run resumes without float8 and the reverse), loss tracking against fp32, and the trainer wiring.

Float8 + FSDP2 (all-gather on/off), float8 TP styles and DCP live in tests/multiproc/test_dist_float8.py.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import float8
from float8.filter import fqn_matches
from tests.multiproc.par_helpers import global_batch, loss_fn, meta_model, reference_model
from titanlike.config import ConfigError
from titanlike.config.load import config_from_dict
from titanlike.config.sections import JobConfig
from titanlike.config.validate import validate

torch.set_num_threads(1)
LINEARS = [f"layers.{i}.{name}" for i in range(2) for name in (
    "attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
    "feed_forward.w3")]
# Loss tolerance against fp32 over 8 AdamW steps of the tiny model (measured: tensorwise 4.8e-4, rowwise 3.1e-4,
# rowwise_with_gw_hp 1.9e-4): float8 rounding of a dim-64 model, far below the step-to-step loss change (~0.1).
LOSS_TOL = 2e-3


def f8cfg(recipe="tensorwise", **kw):
    cfg = JobConfig().float8
    cfg.enable, cfg.recipe = True, recipe
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def float8_fqns(model) -> list[str]:
    from torchao.float8.float8_linear import Float8Linear

    return [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]


@pytest.mark.parametrize("fqn,pattern,hit", [
    ("output", "output", True), ("layers.0.feed_forward.output_proj", "output", False),
    ("layers.3.attention.wq", "attention.wq", True), ("layers.3.attention.wq", "wq", True),
    ("layers.0.attention.wq", "layers.0", True), ("layers.10.attention.wq", "layers.1", False),
    ("layers.1.feed_forward.w1", "layers.1.feed_forward", True), ("layers.1.attention.wk", "attention.wq", False),
])
def test_fqn_matches_whole_components(fqn, pattern, hit):
    assert fqn_matches(fqn, pattern) is hit


def test_converter_swaps_every_linear_but_output():
    model = meta_model()
    conv = float8.convert(model, f8cfg())
    assert conv.converted == LINEARS == float8_fqns(model)
    assert type(model.output) is nn.Linear and conv.skipped == {"output": "float8.filter_fqns has 'output'"}
    assert not conv.fsdp_float8_all_gather and not conv.precompute_scales


def test_filter_rules():
    class Odd(nn.Module):  # a Linear whose out_features (24) is not a multiple of 16
        def __init__(self):
            super().__init__()
            self.proj, self.fine = nn.Linear(64, 24), nn.Linear(64, 32)

    odd = Odd()
    conv = float8.convert(odd, f8cfg(filter_fqns=[]))
    assert conv.converted == ["fine"] and "not multiples of 16" in conv.skipped["proj"]

    # user FQNs: a suffix ("attention.wq") and a whole block ("layers.1")
    model = meta_model()
    conv = float8.convert(model, f8cfg(filter_fqns=["output", "attention.wq", "layers.1"]))
    assert conv.converted == [f for f in LINEARS if f.startswith("layers.0") and f != "layers.0.attention.wq"]
    assert set(conv.skipped) == {"output", "layers.0.attention.wq", *[f for f in LINEARS if f.startswith("layers.1")]}

    # size filter: torchao's thresholds per recipe (tensorwise skips K<=4096 and N<=1024; rowwise is stricter)
    expect = {"tensorwise": ["1", "2"], "rowwise": ["2"], "rowwise_with_gw_hp": ["2"]}
    for recipe, want in expect.items():
        with torch.device("meta"):
            net = nn.Sequential(nn.Linear(4096, 1024), nn.Linear(2048, 4096), nn.Linear(8192, 8192),
                                nn.Linear(64, 64))
        conv = float8.convert(net, f8cfg(recipe, filter_fqns=[], filter_small=True))
        assert conv.converted == want, (recipe, conv.converted)
        assert "too small" in conv.skipped["3"]
    # the tiny test model is all "too small": nothing converts, and that is reported rather than silent
    conv = float8.convert(meta_model(), f8cfg(filter_small=True))
    assert conv.converted == [] and len(conv.skipped) == 15


def test_disabled_and_all_gather_rules():
    model = meta_model()
    off = float8.convert(model, JobConfig().float8)
    assert not off.enabled and float8_fqns(model) == []
    off.post_optimizer_hook(model)  # no-op

    with pytest.raises(ValueError, match="tensorwise"):
        float8.convert(meta_model(), f8cfg("rowwise", enable_fsdp_float8_all_gather=True))
    # no FSDP: nothing is all-gathered, so the request is dropped (and precompute with it)
    conv = float8.convert(meta_model(), f8cfg(enable_fsdp_float8_all_gather=True,
                                              precompute_float8_dynamic_scale_for_fsdp=True))
    assert not conv.fsdp_float8_all_gather and not conv.precompute_scales
    model = meta_model()
    conv = float8.convert(model, f8cfg(enable_fsdp_float8_all_gather=True,
                                       precompute_float8_dynamic_scale_for_fsdp=True), fsdp_enabled=True)
    assert conv.fsdp_float8_all_gather and conv.precompute_scales
    assert type(model.layers["0"].attention.wq.weight).__name__ == "WeightWithDynamicFloat8CastTensor"

    # the config validator names the same rules
    cfg = config_from_dict({"float8": {"enable": True, "recipe": "rowwise", "enable_fsdp_float8_all_gather": True}})
    with pytest.raises(ConfigError, match="enable_fsdp_float8_all_gather needs"):
        validate(cfg)


def test_tp_styles():
    colwise, rowwise, prepare = float8.tp_styles(float8.convert(meta_model(), f8cfg()))
    assert (colwise.__name__, rowwise.__name__, prepare.__name__) == (
        "Float8ColwiseParallel", "Float8RowwiseParallel", "PrepareFloat8ModuleInput")
    colwise, _, _ = float8.tp_styles(float8.convert(meta_model(), f8cfg("rowwise")))
    assert colwise.__name__ == "ColwiseParallel"


@pytest.mark.parametrize("recipe", float8.RECIPES)
def test_state_dict_is_compute_only(recipe):
    """Same keys, dtypes, shapes and values: a float8 checkpoint loads without float8 and the reverse (strict)."""
    plain, fp8 = reference_model(0), reference_model(0)
    float8.convert(fp8, f8cfg(recipe, enable_fsdp_float8_all_gather=recipe == "tensorwise"), fsdp_enabled=True)
    sd, sd8 = plain.state_dict(), fp8.state_dict()
    assert list(sd) == list(sd8)
    for k in sd:
        assert (sd[k].dtype, sd[k].shape) == (sd8[k].dtype, sd8[k].shape), k
        torch.testing.assert_close(sd8[k], sd[k], rtol=0, atol=0)
    other = reference_model(seed=1)
    other.load_state_dict(sd8, strict=True)  # float8 -> plain
    fp8.load_state_dict(reference_model(seed=2).state_dict(), strict=True)  # plain -> float8
    torch.testing.assert_close(fp8.state_dict()["layers.0.attention.wq.weight"],
                               reference_model(seed=2).state_dict()["layers.0.attention.wq.weight"], rtol=0, atol=0)


@pytest.mark.parametrize("recipe", float8.RECIPES)
def test_float8_tracks_fp32_loss(recipe):
    """8 AdamW steps on two alternating batches: float8 follows fp32 within LOSS_TOL, and both learn."""
    def run(cfg):
        model = reference_model(0)
        if cfg is not None:
            assert len(float8.convert(model, cfg).converted) == 14
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for step in range(8):
            inputs, labels = global_batch(step % 2, 4)
            loss = loss_fn(model(inputs), labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    ref, got = run(None), run(f8cfg(recipe))
    assert max(abs(a - b) for a, b in zip(ref, got)) <= LOSS_TOL, (ref, got)
    assert got[-2] < got[0] - 0.1 and got[-1] < got[1] - 0.1, got


def test_trainer_float8_resumes_without_float8(tmp_path):
    """Trainer wiring: float8 converts before the plan; its state dict loads into a run without float8."""
    from titanlike.train.trainer import Trainer

    def cfg(**float8_kw):
        return config_from_dict({
            "job": {"dump_folder": str(tmp_path)}, "model": {"flavor": "debugmodel", "vocab_size": 256},
            "training": {"steps": 2, "seq_len": 8, "local_batch_size": 1, "device": "cpu"},  # (CPU float8: slow)
            "data": {"dataset": "mock"}, "lr_scheduler": {"warmup_steps": 1},
            "metrics": {"log_freq": 1, "enable_tensorboard": False}, "float8": float8_kw})

    t8 = Trainer(cfg(enable=True, recipe="tensorwise"))
    try:
        assert len(t8.float8.converted) == 4 * 7 and float8_fqns(t8.model)
        history = t8.train()
        assert all(h["loss"] == h["loss"] for h in history)  # finite, not NaN
        sd8 = t8.model.state_dict()
    finally:
        t8.close()
    plain = Trainer(cfg())
    try:
        assert float8_fqns(plain.model) == []
        plain.model.load_state_dict(sd8, strict=True)
        plain.train()
    finally:
        plain.close()


def test_compiled_fsdp_cast_is_bit_identical_to_torchao():
    """float8.compile_fsdp_cast: the pre-all-gather weight cast, compiled, gives torchao's exact bytes and scale."""
    from torchao.float8.config import e4m3_dtype
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as W

    from float8 import fsdp_cast

    torch.manual_seed(0)
    shards = [torch.randn(48, 32) * 3, torch.randn(16, 80) * 1e-3, torch.tensor([[1e6, -1e6, 0.1]])]  # (saturates)
    was_enabled = fsdp_cast._original is not None  # (a trainer test in this process may have enabled it)
    torchao_method = fsdp_cast._original or W.fsdp_pre_all_gather
    expected = []
    for hp in shards:
        w = W(hp, LinearMMConfig(), e4m3_dtype, precomputed_scale=torch.tensor(448.0) / hp.abs().max())
        expected.append((w, torchao_method(w, None)))
    assert fsdp_cast.enable_compiled_fsdp_cast() and fsdp_cast.enable_compiled_fsdp_cast()  # idempotent
    try:
        assert W.fsdp_pre_all_gather is fsdp_cast._fused_pre_all_gather and fsdp_cast._original is torchao_method
        for w, ((data,), (scale,)) in expected:
            (got,), (got_scale,) = w.fsdp_pre_all_gather(None)
            assert got.dtype == e4m3_dtype and got_scale is scale
            assert torch.equal(got.view(torch.uint8), data.view(torch.uint8))
    finally:
        if not was_enabled:
            W.fsdp_pre_all_gather, fsdp_cast._original = torchao_method, None
