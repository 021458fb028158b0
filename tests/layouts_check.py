"""One model, five layouts, one seed checkpoint (shared by the GPU and the gloo test):

  seed  1 process   --checkpoint.create_seed_checkpoint
  A     2 ranks     FSDP 2                       all steps          the reference ("fewer devices")
  B     4 ranks     TP 2 x PP 2 (1F1B)           all steps, full checkpoint half-way
  C     4 ranks     TP 4                         all steps (tp4=False leaves it out)
  D     2 ranks     FSDP 2, from B's checkpoint  second half    } side by side
  E     1 process   from B's checkpoint          second half    }

The caller gives the common train.py arguments (model, dtype, seq, global batch 8, steps) and where each run goes
(`devices(n)`: extra environment for a run of n ranks, e.g. CUDA_VISIBLE_DEVICES). Returns the per-step losses of
every run and the largest loss difference of each comparison.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from tests.launch import REPO_ROOT, run_torchrun

LOSS = re.compile(r"step\s+(\d+)\s+loss\s+([\d.]+)")


def _losses(out: str) -> dict[int, float]:
    losses = {int(m[1]): float(m[2]) for m in LOSS.finditer(out)}
    assert losses, out[-4000:]
    return losses


def run_layouts(dump, common: list[str], steps: int, devices, tp4: bool = True) -> tuple[dict, dict]:
    common = [*common, f"--training.steps={steps}", "--training.global_batch_size=8", "--metrics.log_freq=1",
              "--metrics.enable_tensorboard=false", "--checkpoint.enable=false", f"--job.dump_folder={dump}"]

    def train(name: str, nproc: int, env: dict, *extra) -> dict[int, float]:
        return _losses(run_torchrun(REPO_ROOT / "scripts/train.py", nproc, timeout=420, env=env,
                                    args=[*common, f"--job.run_name={name}", *extra]).stdout)

    seed = subprocess.run([sys.executable, str(REPO_ROOT / "scripts/train.py"), *common, "--job.run_name=seed",
                           "--checkpoint.create_seed_checkpoint"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=420, env={**os.environ, **devices(1, 0)})
    assert seed.returncode == 0, seed.stdout[-3000:] + seed.stderr[-3000:]
    from_seed = [f"--checkpoint.initial_load_path={os.path.join(dump, 'seed', 'checkpoint')}"]
    half = steps // 2

    a = train("fsdp2", 2, devices(2, 0), "--parallelism.dp_shard=2", "--training.local_batch_size=4", *from_seed)
    b = train("tp2pp2", 4, devices(4, 0), "--parallelism.tp=2", "--parallelism.pp=2", "--parallelism.dp_shard=1",
              "--training.local_batch_size=8", "--parallelism.pp_schedule=1F1B", *from_seed,
              "--checkpoint.enable=true", f"--checkpoint.interval={half}", "--checkpoint.last_save_model_only=true")
    c = train("tp4", 4, devices(4, 0), "--parallelism.tp=4", "--parallelism.dp_shard=1",
              "--training.local_batch_size=8", *from_seed) if tp4 else None
    from_b = [f"--checkpoint.initial_load_path={os.path.join(dump, 'tp2pp2', 'checkpoint', f'step-{half}')}",
              "--checkpoint.initial_load_model_only=false"]
    with ThreadPoolExecutor(2) as pool:
        fd = pool.submit(train, "resume_fsdp2", 2, devices(2, 0), "--parallelism.dp_shard=2",
                         "--training.local_batch_size=4", *from_b)
        fe = pool.submit(train, "resume_1", 1, devices(1, 2), "--training.local_batch_size=4", *from_b)
        d, e = fd.result(), fe.result()

    full, tail = range(1, steps + 1), range(half + 1, steps + 1)
    assert sorted(d) == list(tail) and sorted(e) == list(tail), (sorted(d), sorted(e))

    def diff(x, y, span):
        return max(abs(x[s] - y[s]) for s in span)

    diffs = {"tp2pp2_vs_fsdp2": diff(b, a, full),
             "resume_fsdp2_vs_tp2pp2": diff(d, b, tail), "resume_1_vs_tp2pp2": diff(e, b, tail)}
    losses = {"fsdp2": a, "tp2pp2": b, "resume_fsdp2": d, "resume_1": e}
    if c is not None:
        diffs["tp4_vs_fsdp2"], losses["tp4"] = diff(c, a, full), c
    return losses, diffs
