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


def test_tp_plan_logged_at_debug(records):
    """The TP plan (one line per module) is a DEBUG record, not on every run's console."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel

    from parallelize.tp import apply_tp

    if dist.is_initialized():
        pytest.skip("needs its own one-process group")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        apply_tp(model, init_device_mesh("cpu", (1,)), {"0": ColwiseParallel()})
    finally:
        dist.destroy_process_group()
    plan = [r for r in records if r.getMessage().startswith("tensor parallel 1")]
    assert len(plan) == 1 and plan[0].levelno == logging.DEBUG and "ColwiseParallel" in plan[0].getMessage()


def test_log_level_from_env(monkeypatch):
    """TITANLIKE_LOG_LEVEL=DEBUG shows DEBUG records (the TP plan) on rank 0; other ranks stay at WARNING."""
    from titanlike.observe.log import setup_logging

    log = logging.getLogger("titanlike")
    saved = (list(log.handlers), log.level, log.propagate)
    try:
        monkeypatch.setenv("TITANLIKE_LOG_LEVEL", "debug")
        assert setup_logging(0).level == logging.DEBUG and setup_logging(1).level == logging.WARNING
        monkeypatch.setenv("TITANLIKE_LOG_LEVEL", "nonsense")
        assert setup_logging(0).level == logging.INFO
    finally:
        log.handlers[:], log.level, log.propagate = saved


def test_torchao_cpu_only_load_failures_filtered():
    """float8 filters torchao's import-time "Failed to load ..._C*.so" lines where CUDA is absent, nothing else."""
    import subprocess

    import float8  # noqa: F401 - installs the filter on the "torchao" logger

    torchao_log = logging.getLogger("torchao")
    failed = logging.makeLogRecord({"msg": "Failed to load /site/torchao/_C_mxfp8.so: Could not load this library",
                                    "levelno": logging.WARNING})
    other = logging.makeLogRecord({"msg": "Detected no triton", "levelno": logging.WARNING})
    assert bool(torchao_log.filter(failed)) == torch.cuda.is_available() and torchao_log.filter(other)
    # The real import, in a fresh process (torchao logs through logging's last-resort handler: stderr).
    err = subprocess.run([sys.executable, "-c", "import float8, torchao.float8"], capture_output=True, text=True,
                         timeout=120).stderr
    assert torch.cuda.is_available() or "Failed to load" not in err, err


def test_log_lines_follow_stdout_after_it_is_swapped_and_closed(capsys, monkeypatch):
    """A tool run in-process sets up logging while sys.stdout is one stream and logs after it was replaced and closed
    (pytest's capture between tests did this): the line goes to the current stdout, with no logging error."""
    import io
    import logging

    from titanlike.observe.log import setup_logging

    old = io.StringIO()
    monkeypatch.setattr(sys, "stdout", old)
    setup_logging(0)
    monkeypatch.undo()
    old.close()
    logging.getLogger("titanlike").warning("still heard")
    out, err = capsys.readouterr()
    assert "still heard" in out and "Logging error" not in err
