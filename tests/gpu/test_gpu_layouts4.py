"""Four GPUs: a 70B-shaped model under 2-D layouts matches the same model on fewer GPUs, and a checkpoint written
under TP 2 x PP 2 continues under FSDP 2 and on one GPU (the runs: tests/layouts_check.py).

Model: `70B_4L` (Llama 3 70B layer dimensions, 4 layers) with the builtin 2,048-token vocabulary on the stdlib
text, so the 70B-sized blocks dominate (3.4B params) and a full training state (55 GB) saves and loads in seconds.
fp32 throughout (FSDP param dtype float32, no autocast, no TF32): the comparison measures the layouts (their
different matmul splits and reduction orders), not bf16 rounding. Global batch 8 x seq 512, 20 steps.

Run on a 4-GPU machine: `python -m pytest -q tests/gpu/test_gpu_layouts4.py`; with TITANLIKE_RESULTS=DIR the
per-step losses and the differences go to DIR/layouts4.json. Measured: docs/benchmarks.md.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.layouts_check import run_layouts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")]
TOL = 2e-3  # absolute, per step, on losses around 5-8 printed to 4 decimals (fp32; see the module docstring)
STEPS = 20


def _gpus(n: int, first: int) -> dict:
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(first + i) for i in range(n))}


def test_70b_shape_layouts_match_and_reshard(tmp_path):
    common = ["--config", "configs/base_gpu.toml", "--model.flavor=70B_4L", "--training.seq_len=512",
              "--training.mixed_precision_param=float32", "--compile.enable=false",
              "--activation_checkpoint.mode=none", "--lr_scheduler.warmup_steps=2"]
    losses, diffs = run_layouts(str(tmp_path), common, STEPS, _gpus)
    if os.environ.get("TITANLIKE_RESULTS"):
        with open(os.path.join(os.environ["TITANLIKE_RESULTS"], "layouts4.json"), "w") as f:
            json.dump({"losses": losses, "max_abs_diff": diffs, "tol": TOL}, f, indent=1)
    print("max |loss difference|:", diffs)
    assert losses["fsdp2"][STEPS] < losses["fsdp2"][1] - 0.5, losses["fsdp2"]  # it trains
    for name, d in diffs.items():
        assert d <= TOL, (name, d, diffs)
