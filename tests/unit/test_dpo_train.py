"""DPO end to end on one CPU process: the llama3 debug model on a small pairs file (NullTokenizer: text = ids)."""
import json
import math
import os
import random
import subprocess
import sys

import pytest
import torch

from tests.launch import REPO_ROOT
from titanlike.config.load import config_from_dict
from titanlike.train import dpo as dpo_module
from titanlike.train.trainer import Trainer


def write_pairs(path, n=16, seed=0):
    """Pairs a tiny model can tell apart: chosen responses from ids 60-89, rejected from 90-119."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = lambda lo, hi, k: " ".join(str(rng.randrange(lo, hi)) for _ in range(k))  # noqa: E731
        rows.append({"prompt": words(3, 60, rng.randrange(2, 6)), "chosen": words(60, 90, rng.randrange(1, 5)),
                     "rejected": words(90, 120, rng.randrange(1, 5))})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def dpo_cfg(tmp_path, name, pairs, **sections):
    base = {
        "job": {"dump_folder": str(tmp_path), "run_name": name},
        "model": {"flavor": "debugmodel"},
        "training": {"steps": 12, "seq_len": 16, "local_batch_size": 4, "device": "cpu", "gc_freq": 0},
        "data": {"dataset": "preference", "paths": [pairs], "tokenizer_type": "NullTokenizer",
                 "builtin_vocab_size": 127},
        "optimizer": {"lr": 1e-3},
        "lr_scheduler": {"warmup_steps": 1, "decay_type": "constant"},
        "metrics": {"log_freq": 1, "enable_tensorboard": False},
    }
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    return config_from_dict(base)


def train(cfg, stop_after=None):
    trainer = Trainer(cfg)
    if stop_after is not None:  # stop there (the LR schedule keeps the full length)
        trainer.cfg.training.steps = stop_after
    try:
        return trainer.train(), trainer
    finally:
        trainer.close()


@pytest.fixture
def pairs(tmp_path):
    return write_pairs(tmp_path / "pairs.jsonl")


def test_loss_starts_at_ln2_falls_and_reward_accuracy_rises(tmp_path, pairs):
    held_out = write_pairs(tmp_path / "held_out.jsonl", n=8, seed=1)
    trainer = Trainer(dpo_cfg(tmp_path, "run", pairs, validation={"enable": True, "paths": [held_out],
                                                                  "interval": 100, "steps": 2}))
    try:
        history = trainer.train()
        val = trainer.validate()  # the DPO loss on held-out pairs (their reference log-probs were precomputed too)
    finally:
        trainer.close()
    assert val < math.log(2) - 0.1, val
    first, last = history[0], history[-1]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference at step 1
    assert first["dpo/reward_accuracy"] == 0.0 and first["dpo/reward_margin"] == 0.0
    assert last["loss"] < first["loss"] - 0.3, [h["loss"] for h in history]
    assert last["dpo/reward_accuracy"] >= 0.75 and last["dpo/reward_margin"] > 0.1, last
    assert len(trainer.dpo.table) == 32 + 16  # 16 + 8 pairs, two sequences each


def test_precompute_equals_frozen_copy(tmp_path, pairs):
    """The reference log-probs of the precompute pass equal the frozen copy's, row by row; so do whole runs."""
    trainer = Trainer(dpo_cfg(tmp_path, "frozen", pairs, dpo={"reference": "frozen_copy"}))
    try:
        trainer.checkpointer.load()
        d = trainer.dpo
        table = dpo_module.precompute([trainer.dataloader.dataset], d._forward_logps, batch_pairs=4, dp_rank=0,
                                      dp_degree=1, group=None, device=trainer.device)
        ds = trainer.dataloader.dataset
        ids = torch.stack([ds[i][0] for i in range(len(ds))]).flatten(0, 1)
        labels = torch.stack([ds[i][1] for i in range(len(ds))]).flatten(0, 1)
        torch.testing.assert_close(table.lookup(ids, labels), d._forward_logps(ids, labels, copy=d.ref_model),
                                   atol=1e-5, rtol=1e-6)
    finally:
        trainer.close()
    for loss_type in ("sigmoid", "length_normalized"):
        a, _ = train(dpo_cfg(tmp_path, f"pre_{loss_type}", pairs, training={"steps": 4}, dpo={"loss_type": loss_type}))
        b, _ = train(dpo_cfg(tmp_path, f"copy_{loss_type}", pairs, training={"steps": 4},
                             dpo={"loss_type": loss_type, "reference": "frozen_copy"}))
        assert [h["loss"] for h in a] == pytest.approx([h["loss"] for h in b], abs=1e-6)


@pytest.mark.parametrize("reference", ["precompute", "frozen_copy"])
def test_resume_keeps_the_initial_reference(tmp_path, pairs, monkeypatch, reference):
    """Stopped at step 2 and resumed, a run continues exactly: the table comes back from the checkpoint (no second
    pass, whose weights would no longer be the initial ones); the frozen copy is rebuilt from the seeded weights."""
    ckpt = {"enable": True, "interval": 2}
    cfg = lambda name: dpo_cfg(tmp_path, name, pairs, training={"steps": 4}, checkpoint=ckpt,  # noqa: E731
                               dpo={"reference": reference})
    whole, _ = train(cfg("whole"))
    train(cfg("resumed"), stop_after=2)
    calls = []
    real = dpo_module.precompute
    monkeypatch.setattr(dpo_module, "precompute", lambda *a, **k: calls.append(1) or real(*a, **k))
    rest, trainer = train(cfg("resumed"))
    assert [h["step"] for h in rest] == [3, 4] and calls == []
    assert [h["loss"] for h in rest] == pytest.approx([h["loss"] for h in whole[2:]], abs=1e-6)
    if reference == "precompute":
        assert len(trainer.dpo.table) == 32


@pytest.mark.parametrize("reference", ["precompute", "frozen_copy"])
def test_reference_is_the_initial_load_path_weights(tmp_path, pairs, reference):
    """Starting from another run's weights (an SFT model), the reference is those weights: the loss is ln 2 at
    step 1 (a reference left at the seeded initial weights would not give it)."""
    pre = config_from_dict({
        "job": {"dump_folder": str(tmp_path), "run_name": "sft"}, "model": {"flavor": "debugmodel"},
        "training": {"steps": 2, "seq_len": 16, "local_batch_size": 4, "device": "cpu"},
        "data": {"dataset": "mock", "tokenizer_type": "NullTokenizer", "builtin_vocab_size": 127},
        "optimizer": {"lr": 1e-2}, "metrics": {"enable_tensorboard": False},
        "checkpoint": {"enable": True, "interval": 2}})
    train(pre)
    history, trainer = train(dpo_cfg(tmp_path, "dpo", pairs, training={"steps": 1}, dpo={"reference": reference},
                                     checkpoint={"initial_load_path": str(tmp_path / "sft" / "checkpoint")}))
    assert history[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    seeded, _ = train(dpo_cfg(tmp_path, "seeded", pairs, training={"steps": 1}))
    assert history[0]["grad_norm"] != pytest.approx(seeded[0]["grad_norm"], rel=1e-3)  # other weights indeed


def test_identical_pairs_exit_2_with_one_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "1 2", "chosen": "3", "rejected": "4"}) + "\n"
                 + json.dumps({"prompt": "1 2", "chosen": "5 6", "rejected": "5 6"}) + "\n")
    p = subprocess.run([sys.executable, str(REPO_ROOT / "scripts/train.py"), "--config", "configs/dpo_debug.toml",
                        f"--data.paths={f}", "--data.tokenizer_type=NullTokenizer", f"--job.dump_folder={tmp_path}",
                        "--training.device=cpu"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    lines = [line for line in p.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and f"{f}:2): they carry no preference; remove them from the data" in lines[0], p.stderr


PACK = {"preference_layout": "pack", "document_masking": True, "reset_position_ids": True}


def _step_and_run(cfg, steps=3):
    """Step 1's mean loss over its pairs, their count and the gradients (an explicit forward/backward of its
    batches); then `steps` trained steps' history."""
    trainer = Trainer(cfg)
    try:
        trainer.checkpointer.load()
        trainer.dpo.start()
        batches = trainer.next_batches(iter(trainer.dataloader))
        count = sum(b.target_count() for b in batches).float()
        loss = sum(trainer.compute.forward_backward(trainer.model, b, 1 / count) for b in batches) / count
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
        trainer.model.zero_grad(set_to_none=True)
        history = trainer.train()
        rows = len(trainer.dataloader.dataset)
    finally:
        trainer.close()
    return float(loss), float(count), grads, history, rows


@pytest.mark.parametrize("loss_type,reference", [("sigmoid", "precompute"), ("length_normalized", "frozen_copy")])
def test_packed_rows_train_as_padded_pairs(tmp_path, loss_type, reference):
    """The same 12 pairs in one step, padded (12 pairs) and packed (all their rows): the same pair count, loss and
    gradients at step 1 (fp32, 1e-5), and the same losses, grad norms and reward metrics over 3 steps (each step
    all the pairs, so the weights stay equal); pairs per step and pairs/s logged."""
    from titanlike.data.preference import PreferenceDataset
    from titanlike.data.tokenizers.null import NullTokenizer

    pairs = write_pairs(tmp_path / "pairs.jsonl", n=12)
    rows = len(PreferenceDataset([pairs], NullTokenizer(127), 24, layout="pack"))
    assert rows < 12  # (several pairs share a row)
    common = dict(dpo={"loss_type": loss_type, "reference": reference, "beta": 0.5}, optimizer={"lr": 3e-3})
    pad = _step_and_run(dpo_cfg(tmp_path, "pad", pairs, training={"seq_len": 24, "local_batch_size": 12,
                                                                  "steps": 3}, **common))
    pack = _step_and_run(dpo_cfg(tmp_path, "pack", pairs, training={"seq_len": 24, "local_batch_size": rows,
                                                                    "steps": 3}, data=PACK, **common))
    assert pad[1] == pack[1] == 12.0 and pack[4] == rows
    assert pack[0] == pytest.approx(pad[0], abs=1e-5)
    for k, g in pad[2].items():
        torch.testing.assert_close(pack[2][k], g, atol=1e-5, rtol=1e-5, msg=lambda m: f"grad {k}: {m}")
    for key in ("loss", "grad_norm", "dpo/reward_accuracy", "dpo/reward_margin", "dpo/chosen_reward",
                "dpo/rejected_reward"):
        assert [h[key] for h in pack[3]] == pytest.approx([h[key] for h in pad[3]], abs=1e-5), key
    assert pad[3][-1]["loss"] < pad[3][0]["loss"] - 0.01  # (the compared values move)
    for h in pack[3] + pad[3]:
        assert h["dpo/pairs_per_step"] == 12.0 and h["throughput/pairs_per_sec"] > 0


def test_pairs_per_second_on_the_log_line():
    from titanlike.observe.metrics import MetricsLogger

    m = {"loss": 0.69, "dpo/reward_accuracy": 0.5, "dpo/reward_margin": 0.1, "throughput/pairs_per_sec": 1234.5,
         "throughput/tokens_per_sec_per_device": 1000.0}
    assert "margin 0.1000  pairs/s 1,234.50  tok/s" in MetricsLogger.format_line(3, m)
