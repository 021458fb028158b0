"""Four GPUs: a 70B-shaped model under 2-D layouts matches the same model on fewer GPUs, and a checkpoint written
under TP 2 x PP 2 continues under FSDP 2 and on one GPU (issue 9, runs 2 and 3).

Model: `70B_4L` (Llama 3 70B layer dimensions, 4 layers) with the builtin 2,048-token vocabulary on the stdlib
text, so the 70B-sized blocks dominate (3.4B params) and a full training state (55 GB) saves and loads in seconds.
fp32 throughout (FSDP param dtype float32, no autocast, no TF32): the comparison measures the layouts (their
different matmul splits and reduction orders), not bf16 rounding. One seed checkpoint gives every run the same
weights; global batch 8 x seq 512 in every layout.

  seed  1 GPU   --checkpoint.create_seed_checkpoint
  A     2 GPUs  FSDP 2                       20 steps            the reference ("fewer GPUs")
  B     4 GPUs  TP 2 x PP 2 (1F1B, 8 mb)     20 steps, full checkpoint at step 10
  C     4 GPUs  TP 4                         20 steps
  D     2 GPUs  FSDP 2, from B's step 10     steps 11-20    } run side by side
  E     1 GPU   from B's step 10             steps 11-20    }

Run on a 4-GPU machine: `python -m pytest -q tests/gpu/test_gpu_layouts4.py`; with TITANLIKE_RESULTS=DIR the
per-step losses and the differences go to DIR/layouts4.json.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.launch import REPO_ROOT, run_torchrun

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")]
LOSS = re.compile(r"step\s+(\d+)\s+loss\s+([\d.]+)")
TOL = 2e-3  # absolute, per step, on losses around 5-8 printed to 4 decimals (fp32; see the module docstring)
STEPS = 20


def _common(dump) -> list[str]:
    return ["--config", "configs/base_gpu.toml", "--model.flavor=70B_4L", "--training.seq_len=512",
            "--training.global_batch_size=8", f"--training.steps={STEPS}", "--training.mixed_precision_param=float32",
            "--compile.enable=false", "--activation_checkpoint.mode=none", "--metrics.log_freq=1",
            "--metrics.enable_tensorboard=false", "--lr_scheduler.warmup_steps=2", "--checkpoint.enable=false",
            f"--job.dump_folder={dump}"]


def _run(dump, name: str, gpus: str, *extra) -> dict[int, float]:
    nproc = len(gpus.split(","))
    out = run_torchrun(REPO_ROOT / "scripts/train.py", nproc, timeout=420, env={"CUDA_VISIBLE_DEVICES": gpus},
                       args=[*_common(dump), f"--job.run_name={name}", *extra]).stdout
    losses = {int(m[1]): float(m[2]) for m in LOSS.finditer(out)}
    assert losses, out[-4000:]
    return losses


def _max_diff(a: dict[int, float], b: dict[int, float], steps) -> float:
    return max(abs(a[s] - b[s]) for s in steps)


def test_70b_shape_layouts_match_and_reshard(tmp_path):
    dump = tmp_path
    seed = subprocess.run([sys.executable, str(REPO_ROOT / "scripts/train.py"), *_common(dump), "--job.run_name=seed",
                           "--checkpoint.create_seed_checkpoint"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=420, env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
    assert seed.returncode == 0, seed.stdout[-3000:] + seed.stderr[-3000:]
    from_seed = [f"--checkpoint.initial_load_path={dump / 'seed' / 'checkpoint'}"]

    a = _run(dump, "fsdp2", "0,1", "--parallelism.dp_shard=2", "--training.local_batch_size=4", *from_seed)
    b = _run(dump, "tp2pp2", "0,1,2,3", "--parallelism.tp=2", "--parallelism.pp=2", "--parallelism.dp_shard=1",
             "--training.local_batch_size=8", "--parallelism.pp_schedule=1F1B", *from_seed,
             "--checkpoint.enable=true", "--checkpoint.interval=10", "--checkpoint.last_save_model_only=true")
    c = _run(dump, "tp4", "0,1,2,3", "--parallelism.tp=4", "--parallelism.dp_shard=1",
             "--training.local_batch_size=8", *from_seed)
    from_b = [f"--checkpoint.initial_load_path={dump / 'tp2pp2' / 'checkpoint' / 'step-10'}",
              "--checkpoint.initial_load_model_only=false"]
    with ThreadPoolExecutor(2) as pool:
        fd = pool.submit(_run, dump, "resume_fsdp2", "0,1", "--parallelism.dp_shard=2",
                         "--training.local_batch_size=4", *from_b)
        fe = pool.submit(_run, dump, "resume_1gpu", "2", "--training.local_batch_size=4", *from_b)
        d, e = fd.result(), fe.result()

    full, tail = range(1, STEPS + 1), range(11, STEPS + 1)
    diffs = {"tp2pp2_vs_fsdp2": _max_diff(b, a, full), "tp4_vs_fsdp2": _max_diff(c, a, full),
             "resume_fsdp2_vs_tp2pp2": _max_diff(d, b, tail), "resume_1gpu_vs_tp2pp2": _max_diff(e, b, tail)}
    if os.environ.get("TITANLIKE_RESULTS"):
        with open(os.path.join(os.environ["TITANLIKE_RESULTS"], "layouts4.json"), "w") as f:
            json.dump({"losses": {"fsdp2": a, "tp2pp2": b, "tp4": c, "resume_fsdp2": d, "resume_1gpu": e},
                       "max_abs_diff": diffs, "tol": TOL}, f, indent=1)
    print("max |loss difference|:", diffs)
    assert sorted(d) == list(tail) and sorted(e) == list(tail), (sorted(d), sorted(e))
    assert a[STEPS] < a[1] - 0.5, a  # it trains
    for name, diff in diffs.items():
        assert diff <= TOL, (name, diff, diffs)
