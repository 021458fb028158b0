"""The GPT family under TP 2 (sequence and loss parallel on and off) and FSDP 2, tied and untied embeddings, against
one process (gloo, fp32, 1e-5: loss, gradients, parameters after 3 SGD steps; checks in gpt_worker.py), and the
trainer under CP 2, TP 2 and tied PP 2 (1F1B, Interleaved1F1B, ZBVZeroBubble; its checkpoint loads into one process)
logging one process's losses."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import REPO_ROOT, full_matrix, repo_pythonpath, run_torchrun

WORKER = Path(__file__).with_name("gpt_worker.py")
EXPECTED = ["tp2_sp_lp_tied", "tp2_tied", "tp2_sp_untied", "fsdp2_tied", "fsdp2_untied"]


@pytest.mark.dist
def test_gpt_tp2_and_fsdp2_match_one_process():
    out = run_torchrun(WORKER, 2, timeout=180).stdout
    assert "ALL CHECKS PASSED" in out, out
    passed = [line[len("CHECK "):] for line in out.splitlines() if line.startswith("CHECK ")]
    for name in EXPECTED:
        assert any(p.startswith(f"{name} ok") for p in passed), f"check {name!r} did not pass:\n{out}"


def _losses(out: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"step +(\d+) +loss +([0-9.]+)", out)}


def _train_one(tmp_path: Path, name: str, args: list[str]) -> str:
    one = subprocess.run([sys.executable, str(REPO_ROOT / "scripts/train.py"), *args,
                          f"--job.dump_folder={tmp_path / name}"], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=180, env={**os.environ, "PYTHONPATH": repo_pythonpath()})
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    return one.stdout + one.stderr


@pytest.mark.dist
def test_gpt_trainer_layouts_follow_one_process(tmp_path):
    """scripts/train.py on configs/gpt2_debug.toml (fp32 CPU), the tied flavor at 4 layers: context parallel 2
    (position ids of the load-balanced chunks), TP 2 (the re-tied vocabulary-sharded embedding/output) and PP 2
    (pos_embeddings on the first stage, the last stage's own copy of the embedding, gradients summed with the first
    stage's: parallelize/tied.py) under 1F1B, Interleaved1F1B (4 stages, the copy on the other rank) and
    ZBVZeroBubble (first and last stage on rank 0: summed locally) log one process's losses (4 decimals) from the
    same seed: the seeded initial weights and every step. The tied 1F1B run's step-6 checkpoint holds the
    one-process keys with the two copies equal, and loads into one process (pp=1, strict) with the one-process
    run's weights of that step. And the one-process step-6 checkpoint (the tie's optimizer state saved once, under
    the embedding's name) resumes in full under PP 2: the last stage's copy takes the embedding's moments, and
    steps 7-8 follow the uninterrupted one-process run. One reference run serves every layout. TP 2 and
    Interleaved1F1B run with TITANLIKE_TEST_FULL=1 only."""
    base = ["--config", "configs/gpt2_debug.toml", "--training.device=cpu", "--training.steps=8",
            "--metrics.log_freq=1", "--metrics.enable_tensorboard=false", "--lr_scheduler.warmup_steps=2",
            "--model.flavor=debugmodel", "--model.n_layers=4"]
    # Tied PP: the last stage's copy decays by its source's (embedding) rule, as in one process.
    saving = ["--checkpoint.enable=true", "--checkpoint.interval=6"]
    want = _losses(_train_one(tmp_path, "one", [*base, *saving]))
    assert sorted(want) == list(range(1, 9)), want
    layouts = [("cp2", ["--parallelism.cp=2"]), ("tied_pp2", ["--parallelism.pp=2", *saving]),
               ("tied_pp2_zbv", ["--parallelism.pp=2", "--parallelism.pp_schedule=ZBVZeroBubble"])]
    if full_matrix():  # TP 2's re-tied sharded embedding: test_gpt_tp2_and_fsdp2_match_one_process; the tie across
        # ranks: tied_pp2 (1F1B), and Interleaved1F1B itself: test_dist_pp.py
        layouts += [("tp2", ["--parallelism.tp=2"]),
                    ("tied_pp2_interleaved", ["--parallelism.pp=2", "--parallelism.pp_schedule=Interleaved1F1B"])]
    for name, layout_flags in layouts:
        run = run_torchrun(REPO_ROOT / "scripts/train.py", 2, timeout=180,
                           args=[*base, *layout_flags, "--parallelism.dp_shard=1",
                                 f"--job.dump_folder={tmp_path / name}"])
        got = _losses(run.stdout + run.stderr)
        assert got.keys() == want.keys() and all(abs(got[s] - want[s]) <= 2e-4 for s in want), (name, got, want)
    _check_tied_checkpoint(tmp_path / "tied_pp2", tmp_path / "one")
    step6 = next((tmp_path / "one").glob("*/checkpoint/step-6"))
    run = run_torchrun(REPO_ROOT / "scripts/train.py", 2, timeout=180,
                       args=[*base, "--parallelism.pp=2", "--parallelism.dp_shard=1",
                             f"--checkpoint.initial_load_path={step6}", "--checkpoint.initial_load_model_only=false",
                             f"--job.dump_folder={tmp_path / 'resume_pp2'}"])
    got = _losses(run.stdout + run.stderr)
    assert sorted(got) == [7, 8] and "loaded full training state" in run.stdout + run.stderr, run.stdout[-2000:]
    assert all(abs(got[s] - want[s]) <= 2e-4 for s in got), (got, want)


def _check_tied_checkpoint(pp_dir: Path, one_dir: Path) -> None:
    """The PP 2 checkpoint of a tied model: the keys of one process's, tok_embeddings.weight == output.weight, and
    a strict load into the one-process (tied) model gives the one-process run's final weights."""
    import torch

    from titanlike.checkpoint.loading import load_model_weights
    from titanlike.checkpoint.states import full_model_state, model_from_meta

    pp_step, one_step = (next(d.glob("*/checkpoint/step-6")) for d in (pp_dir, one_dir))  # of 8 steps
    saved, ref = full_model_state(str(pp_step)), full_model_state(str(one_step))
    assert saved.keys() == ref.keys() and "output.weight" in saved, sorted(set(saved) ^ set(ref))
    assert torch.equal(saved["tok_embeddings.weight"], saved["output.weight"]), "the two copies drifted apart"
    model, _ = model_from_meta(str(pp_step))
    model.to_empty(device="cpu")
    model.tie_weights()
    assert load_model_weights(str(pp_step), model, strict=True) == 6
    assert model.output.weight is model.tok_embeddings.weight
    for name, p in model.state_dict().items():
        assert torch.allclose(p, ref[name], atol=1e-5, rtol=0), (name, (p - ref[name]).abs().max())


@pytest.mark.dist
def test_gpt_fp16_loss_scaling_under_fsdp_follows_one_process(tmp_path):
    """fp16 dynamic loss scaling (fp32 compute on CPU, so the overflows come from a scale too large for fp32's
    grad norm): FSDP 2 skips the same steps and moves the scale the same way as one process (the overflow is
    decided on the global norm), and logs the same losses."""
    common = ["--config", "configs/gpt2_debug.toml", "--training.device=cpu", "--training.steps=8",
              "--metrics.log_freq=1", "--metrics.enable_tensorboard=false", "--lr_scheduler.warmup_steps=2",
              "--training.mixed_precision_param=float16", f"--loss_scaling.initial_scale={2.0**70}",
              "--loss_scaling.hysteresis=1", "--loss_scaling.window=2"]
    pattern = r"step +(\d+) +loss +([0-9.]+) .*?loss_scale (\d+)"
    one = subprocess.run([sys.executable, str(REPO_ROOT / "scripts/train.py"), *common,
                          f"--job.dump_folder={tmp_path / 'one'}"], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=180, env={**os.environ, "PYTHONPATH": repo_pythonpath()})
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    want = {int(s): (float(v), int(k)) for s, v, k in re.findall(pattern, one.stdout + one.stderr)}
    scales = [want[s][1] for s in sorted(want)]
    assert sorted(want) == list(range(1, 9)) and scales[1] < scales[0] and max(scales[2:]) > min(scales), want
    run = run_torchrun(REPO_ROOT / "scripts/train.py", 2, timeout=180,
                       args=[*common, "--parallelism.dp_shard=2", "--training.local_batch_size=4",
                             f"--job.dump_folder={tmp_path / 'fsdp'}"])
    got = {int(s): (float(v), int(k)) for s, v, k in re.findall(pattern, run.stdout + run.stderr)}
    assert got.keys() == want.keys(), (got, want)
    for s in want:
        assert abs(got[s][0] - want[s][0]) <= 2e-4 and got[s][1] == want[s][1], (s, got, want)
