"""Non-finite steps are skipped (parameters and optimizer state untouched), counted, and stop the run when they
repeat; loss spikes are flagged."""
import logging
import math

import pytest
import torch

from titanlike.config.load import config_from_dict
from titanlike.resilience.nonfinite import NonFiniteError, NonFiniteGuard, SpikeDetector
from titanlike.train.trainer import Trainer


@pytest.mark.parametrize("fused", [True, False])
def test_guard_skips_nonfinite_update(fused):
    """fused: the kernel skips via found_inf (no host sync); foreach: the host skips optimizer.step()."""
    m = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, **({"fused": True} if fused else {"foreach": True}))
    guard = NonFiniteGuard(opt, torch.device("cpu"), max_consecutive=2)
    assert guard.on_device is fused
    for step, bad in ((1, False), (2, True), (3, False)):
        m(torch.ones(2, 4)).sum().backward()
        before = m.weight.detach().clone()
        norm = torch.tensor(float("nan") if bad else 1.0)
        if guard.before_optimizer_step(step, [torch.tensor(1.0)], norm):
            opt.step()
        opt.zero_grad()
        assert torch.equal(before, m.weight) == bad, step
    assert opt.state[m.weight]["step"].item() == 2  # the skipped step did not count
    assert guard.check() == 1


def test_guard_stops_after_consecutive_bad_steps():
    m = torch.nn.Linear(2, 2)
    guard = NonFiniteGuard(torch.optim.AdamW(m.parameters(), fused=True), torch.device("cpu"), max_consecutive=3)
    for step in (1, 2, 3, 4):
        guard.before_optimizer_step(step, [torch.tensor(1.0)], torch.tensor(1.0 if step == 1 else math.inf))
    with pytest.raises(NonFiniteError, match="3 consecutive steps.*first at step 2"):
        guard.check()


def test_spike_detector():
    det = SpikeDetector(window=20, zscore=4.0)
    assert not any(det.update(i, 3.0 + 0.01 * (i % 3)) for i in range(20))
    assert det.update(21, 5.0)


def _cfg(tmp_path, **training):
    return config_from_dict({
        "job": {"dump_folder": str(tmp_path)},
        "model": {"flavor": "debugmodel", "vocab_size": 128},
        "training": {"steps": 4, "seq_len": 16, "local_batch_size": 2, "device": "cpu", **training},
        "data": {"dataset": "mock"}, "lr_scheduler": {"warmup_steps": 1},
        "metrics": {"log_freq": 1, "enable_tensorboard": False}})


def _poison(trainer, bad_calls):
    """Make the loss NaN on the given (1-based) forward calls: a stand-in for a bad batch or an overflow."""
    loss_fn, calls = trainer.loss_fn, [0]

    def poisoned(logits, labels):
        calls[0] += 1
        out = loss_fn(logits, labels)
        return out * float("nan") if calls[0] in bad_calls else out
    trainer.loss_fn = poisoned


def test_trainer_skips_a_nan_batch_and_continues(tmp_path):
    trainer = Trainer(_cfg(tmp_path))
    _poison(trainer, {2})
    try:
        hist = trainer.train()
    finally:
        trainer.close()
    assert math.isnan(hist[1]["loss"]) and hist[1]["skipped_steps"] == 1
    assert all(math.isfinite(h["loss"]) for h in (hist[0], hist[2], hist[3]))
    assert all(math.isfinite(p.detach().sum().item()) for p in trainer.model.parameters())


def test_trainer_stops_on_repeated_nan(tmp_path):
    trainer = Trainer(_cfg(tmp_path, max_consecutive_bad_steps=2))
    _poison(trainer, {2, 3, 4})
    try:
        with pytest.raises(NonFiniteError, match="first at step 2"):
            trainer.train()
    finally:
        trainer.close()


def test_trainer_rolls_back_past_bad_batches(tmp_path, caplog, own_log):
    """max_rollbacks: two NaN steps after the step-4 checkpoint -> back to step 4, the data goes on after the bad
    batches and the run finishes; with no rollbacks left the same failure stops the run."""
    ckpt = {"enable": True, "interval": 4, "keep_latest_k": 0}
    cfg = _cfg(tmp_path, steps=8, max_consecutive_bad_steps=2, max_rollbacks=1)
    cfg.checkpoint = config_from_dict({"checkpoint": ckpt}).checkpoint
    trainer = Trainer(cfg)
    _poison(trainer, {5, 6, 9, 10})  # forward calls = steps 5, 6 first time; steps 7, 8 after the rollback
    try:
        with pytest.raises(NonFiniteError, match="first at step 7"):
            trainer.train()
    finally:
        trainer.close()
    assert trainer.rollbacks == 2 and trainer.step == 8

    cfg = _cfg(tmp_path / "b", steps=8, max_consecutive_bad_steps=2, max_rollbacks=1)
    cfg.checkpoint = config_from_dict({"checkpoint": ckpt}).checkpoint
    trainer = Trainer(cfg)
    _poison(trainer, {5, 6})
    seen, next_batches = [], trainer.next_batches

    def recording(it):
        batches = next_batches(it)
        seen.append(tuple(batches[0].inputs["tokens"].flatten().tolist()))
        return batches
    trainer.next_batches = recording
    try:
        log = logging.getLogger("titanlike")  # (scripts/train.py's setup_logging stops propagation to caplog's root)
        log.addHandler(caplog.handler)
        hist = trainer.train()
    finally:
        log.removeHandler(caplog.handler)
        trainer.close()
    assert "rolled back from step 6" in own_log(0) and "stopping" not in own_log(0), own_log(0)
    steps = [h["step"] for h in hist]
    assert steps == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8], steps  # steps 5-6 again after the rollback to step 4
    assert all(math.isfinite(h["loss"]) for h in hist[6:]) and trainer.rollbacks == 1
    assert len(seen) == 10 and len(set(seen)) == 10  # after the rollback new batches, not the ones that went bad
