"""The 4-GPU layout check (tests/gpu/test_gpu_layouts4.py) on CPU with gloo: the debug model under TP 2 x PP 2
(4 processes) follows FSDP 2 (2 processes) from one seed checkpoint, and TP 2 x PP 2's checkpoint continues under
FSDP 2 and in one process with the same losses. fp32; the losses are logged to 4 decimals. TP 4, which the GPU test
adds, is left to tests/multiproc/test_dist_tp.py here (four processes on two cores are the suite's dearest runs)."""
from __future__ import annotations

from tests.layouts_check import run_layouts

TOL = 2e-4  # two units of the logged precision


def test_layouts_match_and_reshard_on_gloo(tmp_path):
    common = ["--config", "configs/debug_model.toml", "--training.device=cpu", "--training.seq_len=32",
              "--compile.enable=false", "--lr_scheduler.warmup_steps=2"]
    losses, diffs = run_layouts(str(tmp_path), common, 6, lambda n, first: {}, tp4=False)
    assert losses["fsdp2"][6] < losses["fsdp2"][1], losses["fsdp2"]
    for name, d in diffs.items():
        assert d <= TOL, (name, d, diffs)
