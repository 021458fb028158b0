"""What a run reports: a time-stamped TensorBoard folder per process, Weights & Biases offline (the same scalars,
the config), one ConfigError line without the wandb package, and the quieter start-up (TP plan at DEBUG, torchao's
CPU-only "Failed to load" lines filtered)."""
from __future__ import annotations

import logging
import re
import sys

import pytest
import torch

from titanlike.config.errors import ConfigError
from titanlike.config.load import config_from_dict
from titanlike.observe.metrics import MetricsLogger


@pytest.fixture
def records():
    """The "titanlike" logger's records (it does not propagate to pytest's caplog once setup_logging ran)."""
    got: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = got.append
    log = logging.getLogger("titanlike")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    yield got
    log.removeHandler(handler)
    log.setLevel(level)


def _logger(tmp_path, **kw) -> MetricsLogger:
    return MetricsLogger(log_dir=str(tmp_path / "tb"), device=torch.device("cpu"), flops_per_token=1.0,
                         is_rank0=True, enable_tensorboard=True, **kw)


def test_tensorboard_folder_per_process(tmp_path, records):
    """Two processes of one run name (or a run and its resumption) write separate time-stamped folders."""
    first, second = _logger(tmp_path), _logger(tmp_path)
    for m in (first, second):
        m.add_tokens(100)
        m.log(1, {"loss": 2.0, "grad_norm": 1.0, "lr": 1e-3})
        m.close()
    folders = sorted(p.name for p in (tmp_path / "tb").iterdir())
    assert len(folders) == 2 and all(re.fullmatch(r"\d{8}-\d{6}(-\d+)?", f) for f in folders), folders
    assert all(any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb" / f).iterdir())
               for f in folders)
    said = [r.getMessage() for r in records if r.getMessage().startswith("TensorBoard:")]
    assert said == [f"TensorBoard: {first.tb_dir}  (tensorboard --logdir {tmp_path / 'tb'})",
                    f"TensorBoard: {second.tb_dir}  (tensorboard --logdir {tmp_path / 'tb'})"]


def _cfg(tmp_path, **metrics):
    return config_from_dict({
        "job": {"dump_folder": str(tmp_path), "run_name": "run", "description": "wandb offline check"},
        "model": {"flavor": "debugmodel", "vocab_size": 256},
        "training": {"steps": 2, "seq_len": 32, "local_batch_size": 2, "device": "cpu"},
        "data": {"dataset": "mock"},
        "validation": {"enable": True, "interval": 2, "steps": 1},
        "metrics": {"log_freq": 1, "enable_tensorboard": False, "enable_wandb": True, **metrics},
    })


def test_wandb_offline_run(tmp_path, monkeypatch):
    """A short run with metrics.enable_wandb under WANDB_MODE=offline writes its offline W&B run: the training and
    validation scalars and the run's config."""
    pytest.importorskip("wandb")
    from titanlike.train.trainer import Trainer

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    trainer = Trainer(_cfg(tmp_path / "out"))
    try:
        trainer.train()
    finally:
        trainer.close()
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, list((tmp_path / "wb").rglob("*"))
    data = runs[0].read_bytes()  # W&B's record stream: protobuf records holding the keys and JSON values as text
    for key in (b"loss", b"grad_norm", b"lr", b"throughput/tokens_per_sec_per_device", b"memory/max_rss_gib",
                b"validation/loss", b"debugmodel", b"wandb offline check"):
        assert key in data, key


def test_wandb_missing_or_bad_mode_is_one_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ConfigError, match=r"^metrics.enable_wandb needs the wandb package: "
                                          r"pip install 'titanlike\[wandb\]'"):
        _logger(tmp_path, job_config=_cfg(tmp_path), run_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="metrics.wandb_mode='offlne' is not one of online, offline, disabled"):
        _logger(tmp_path, job_config=_cfg(tmp_path, wandb_mode="offlne"), run_dir=str(tmp_path))
    # Off (the default): wandb is never imported.
    assert _logger(tmp_path, job_config=_cfg(tmp_path, enable_wandb=False)).wandb is None
