"""fp16 loss scaling (titanlike/optim/loss_scale.py): Megatron's dynamic rules step by step, the unscale folded into
the clip, and the trainer on CPU: skipped steps leave the weights and the LR schedule alone, a power-of-two static
scale changes nothing in fp32, and a resumed run continues with the same scale (exact); and [loss_scaling] in a TOML,
which the config check rejects where Megatron's --loss-scale flags would, one line each."""
import logging
from pathlib import Path

import pytest
import torch

from titanlike.config import ConfigError, load_config
from titanlike.config.load import config_from_dict
from titanlike.config.sections import LossScaling
from titanlike.observe.metrics import megatron_format
from titanlike.optim.adamw import clip_grad_norm_
from titanlike.optim.loss_scale import LossScaler
from titanlike.train.trainer import Trainer


def megatron_reference(overflows, scale, min_scale, window, hysteresis):
    """Megatron-LM's DynamicGradScaler.update, written out plainly: the scale after each step."""
    growth, hyst, out = 0, hysteresis, []
    for found_inf in overflows:
        if found_inf:
            growth = 0
            hyst -= 1
            if hyst <= 0:
                scale = max(scale * 0.5, min_scale)
        else:
            growth += 1
            if growth == window:
                growth, hyst = 0, hysteresis
                scale *= 2.0
        out.append(scale)
    return out


def test_dynamic_scale_follows_megatron_rules():
    cfg = LossScaling(initial_scale=2.0**16, min_scale=2.0**13, window=3, hysteresis=2)
    overflows = [1, 0, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 0]
    scaler = LossScaler(cfg, torch.device("cpu"))
    got = []
    for o in overflows:
        scaler.overflow(torch.tensor(float("inf") if o else 1.0))
        scaler.update(torch.tensor(1.0))
        got.append(scaler.scale.item())
    assert got == megatron_reference(overflows, 2.0**16, 2.0**13, 3, 2)
    assert scaler.skipped.item() == sum(overflows)
    assert not scaler.at_floor().item()  # the last step was clean
    scaler.overflow(torch.tensor(float("nan")))
    assert scaler.at_floor().item() == (scaler.scale.item() <= 2.0**13)


def test_static_scale_never_moves_and_state_round_trips():
    scaler = LossScaler(LossScaling(static_scale=128.0), torch.device("cpu"))
    for o in [1, 0, 0, 1]:
        scaler.overflow(torch.tensor(float("inf") if o else 1.0))
        assert scaler.at_floor().item() == bool(o)  # a static scale cannot answer an overflow
        scaler.update(torch.tensor(float("nan") if o else 1.0))
    assert scaler.scale.item() == 128.0 and scaler.skipped.item() == 2 and scaler.nan_steps.item() == 2
    m = scaler.log_metrics()
    assert m == {"loss_scale": 128.0, "skipped_iters": 2, "nan_iters": 2}
    assert scaler.log_metrics()["skipped_iters"] == 0  # per interval, as Megatron logs
    dyn = LossScaler(LossScaling(window=5), torch.device("cpu"))
    dyn.overflow(torch.tensor(1.0))
    dyn.update()
    other = LossScaler(LossScaling(window=5, initial_scale=4.0), torch.device("cpu"))
    other.load_state_dict(dyn.state_dict())
    assert other.state_dict() == dyn.state_dict()


@pytest.mark.parametrize("fused", [False, True])
def test_clip_divides_out_the_loss_scale(fused):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    true = [torch.randn(5, 3) for _ in params]
    S = torch.tensor(2.0**20)
    for p, g in zip(params, true):
        p.grad = g * S
    want_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in true]))
    coef = min(1.0, 1.0 / (want_norm.item() + 1e-6))
    opt = torch.optim.AdamW(params)
    norm = clip_grad_norm_(params, 1.0, fused_into=[opt] if fused else None, loss_scale=S)
    assert torch.allclose(norm, want_norm, rtol=1e-6)
    for p, g in zip(params, true):
        got = p.grad / opt.grad_scale if fused else p.grad  # the fused kernel divides by grad_scale
        assert torch.allclose(got, g * coef, rtol=1e-5, atol=1e-7)


def _cfg(tmp_path, steps=8, **sections):
    base = {
        "job": {"dump_folder": str(tmp_path)},
        "model": {"flavor": "debugmodel", "vocab_size": 256},
        "training": {"steps": steps, "seq_len": 32, "local_batch_size": 4, "device": "cpu", "max_norm": 1.0},
        "data": {"dataset": "mock"},
        "lr_scheduler": {"warmup_steps": 2},
        "metrics": {"log_freq": 1, "enable_tensorboard": False},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return config_from_dict(base)


def _run(cfg):
    trainer = Trainer(cfg)
    try:
        return trainer.train(), {k: v.clone() for k, v in trainer.model.state_dict().items()}
    finally:
        trainer.close()


def test_power_of_two_static_scale_changes_nothing(tmp_path):
    """fp32 compute (CPU): multiplying the loss by 2**10 and dividing the gradients back is exact."""
    plain, p_plain = _run(_cfg(tmp_path / "a", training={"mixed_precision_param": "float32"}))
    fp16, p_fp16 = _run(_cfg(tmp_path / "b", training={"mixed_precision_param": "float16"},
                             loss_scaling={"static_scale": 1024.0}))
    assert [h["loss"] for h in fp16] == pytest.approx([h["loss"] for h in plain], rel=1e-6)
    assert all(h["loss_scale"] == 1024.0 and h["skipped_iters"] == 0 for h in fp16)
    for k in p_plain:
        torch.testing.assert_close(p_fp16[k], p_plain[k], rtol=1e-5, atol=1e-6)


def test_overflow_skips_halves_and_resumes_exactly(tmp_path, caplog):
    """2**66 overflows fp32's grad norm on CPU: those steps are skipped (weights, LR schedule untouched) and halve
    the scale (hysteresis 1) until it fits; two clean steps (window 2) double it again. A run stopped at step 6 and
    resumed ends where the uninterrupted one does, scale and counters included; Megatron's log line is printed."""
    fp16 = dict(training={"mixed_precision_param": "float16"}, metrics={"log_format": "megatron"},
                loss_scaling={"initial_scale": 2.0**66, "hysteresis": 1, "window": 2})
    ck = {"enable": True, "interval": 6, "folder": "ckpt"}
    with caplog.at_level(logging.INFO, logger="titanlike"):
        full, p_full = _run(_cfg(tmp_path / "full", steps=12, checkpoint=ck, **fp16))
    scales = [h["loss_scale"] for h in full]
    skipped = [h["skipped_iters"] for h in full]
    assert skipped[0] == 1 and 0 in skipped, (scales, skipped)
    first_ok = skipped.index(0)
    assert scales[:first_ok] == [2.0**(65 - i) for i in range(first_ok)]  # halved at each skipped step
    assert all(h["lr"] == full[0]["lr"] for h in full[:first_ok + 1])  # the schedule waits for a real update
    assert any(b > a for a, b in zip(scales[first_ok:], scales[first_ok + 1:]))  # a clean window doubles it
    line = next(r.getMessage() for r in caplog.records if "iteration" in r.getMessage())
    assert "| consumed samples:            4 |" in line and "| number of skipped iterations:   1 |" in line

    cut = _cfg(tmp_path / "cut", steps=6, checkpoint=ck, **fp16)
    _run(cut)
    resumed, p_res = _run(_cfg(tmp_path / "cut", steps=12, checkpoint=ck, **fp16))
    assert [h["step"] for h in resumed] == list(range(7, 13))
    for a, b in zip(resumed, full[6:]):
        assert (a["loss"], a["loss_scale"], a["lr"], a["grad_norm"]) == (b["loss"], b["loss_scale"], b["lr"],
                                                                         b["grad_norm"])
    for k in p_full:
        assert torch.equal(p_res[k], p_full[k]), k


@pytest.mark.parametrize("scaling, names", [
    ({"static_scale": 2.0**66}, "at the static loss scale 7.3787e+19: lower loss_scaling.static_scale"),
    ({"initial_scale": 2.0**66, "min_scale": 2.0**66}, "at its floor, loss_scaling.min_scale = 7.3787e+19: lower "
                                                       "loss_scaling.min_scale")])
def test_a_stop_for_overflows_at_the_floor_names_the_loss_scale_keys(tmp_path, scaling, names):
    """2**66 overflows fp32's grad norm on CPU at every step and cannot be lowered: the run stops after
    training.max_consecutive_bad_steps, and the fix is the scale's key, not the learning rate (finite losses)."""
    from titanlike.resilience.nonfinite import NonFiniteError

    cfg = _cfg(tmp_path, steps=4, training={"mixed_precision_param": "float16", "max_consecutive_bad_steps": 2},
               loss_scaling=scaling)
    with pytest.raises(NonFiniteError) as err:
        _run(cfg)
    msg = str(err.value)
    assert "2 consecutive steps" in msg and names in msg and "optimizer.lr" not in msg and "\n" not in msg, msg


def test_megatron_line_fields():
    line = megatron_format(609, {"loss": 6.159759, "lr": 5.999998e-05, "grad_norm": 1.0951, "loss_scale": 131072.0,
                                 "skipped_iters": 0, "nan_iters": 0}, 438.3, 500000, 32)
    assert line.split("] ", 1)[1] == (
        "iteration      609/  500000 | consumed samples:        19488 | elapsed time per iteration (ms): 438.3 | "
        "learning rate: 5.999998E-05 | global batch size:    32 | lm loss: 6.159759E+00 | loss scale: 131072.0 | "
        "grad norm: 1.095 | number of skipped iterations:   0 | number of nan iterations:   0 |")


# ------------------------------------------------------------------------------------ [loss_scaling] in a TOML
def _load(tmp_path: Path, body: str, *extra: str):
    path = tmp_path / "run.toml"
    path.write_text(f'[training]\nmixed_precision_param = "float16"\n\n[loss_scaling]\n{body}\n')
    return load_config(["--config", str(path), *extra], world_size=1)


def test_megatron_defaults_and_a_static_scale_load(tmp_path: Path) -> None:
    cfg = _load(tmp_path, "")
    assert (cfg.loss_scaling.static_scale, cfg.loss_scaling.initial_scale) == (0.0, 2.0 ** 32)
    assert (cfg.loss_scaling.min_scale, cfg.loss_scaling.window, cfg.loss_scaling.hysteresis) == (1.0, 1000, 2)
    assert _load(tmp_path, "static_scale = 128.0").loss_scaling.static_scale == 128.0


@pytest.mark.parametrize("body,message", [
    ("static_scale = -1.0", "loss_scaling.static_scale=-1.0 must be >= 0 (0 = dynamic loss scaling"),
    ("initial_scale = 0.0", "loss_scaling.initial_scale=0.0 must be a finite number > 0"),
    ("initial_scale = inf", "loss_scaling.initial_scale=inf must be a finite number > 0"),
    ("min_scale = -2.0", "loss_scaling.min_scale=-2.0 must be a finite number > 0"),
    ("min_scale = 1024.0\ninitial_scale = 512.0", "loss_scaling.min_scale=1024.0 must be <= "
                                                  "loss_scaling.initial_scale=512.0"),
    ("window = 0", "loss_scaling.window=0 must be >= 1"),
    ("hysteresis = 0", "loss_scaling.hysteresis=0 must be >= 1"),
])
def test_bad_loss_scaling_is_one_line_naming_the_key(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, body)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_an_override_is_checked_too(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="loss_scaling.hysteresis=-1 must be >= 1"):
        _load(tmp_path, "", "--loss_scaling.hysteresis=-1")
