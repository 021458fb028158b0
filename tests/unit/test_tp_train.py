"""scripts/train.py with tensor parallel 2 (sequence + loss parallel, the defaults) under torchrun on gloo: it
learns and logs the plan."""
import pytest

from tests.launch import REPO_ROOT, run_torchrun

SCRIPT = str(REPO_ROOT / "scripts/train.py")


@pytest.mark.dist
@pytest.mark.slow
def test_torchrun_tp2_learns(tmp_path):
    out = run_torchrun(SCRIPT, 2, timeout=240, args=[
        "--config", "configs/debug_model.toml", "--parallelism.tp", "2", f"--job.dump_folder={tmp_path}",
        "--training.device=cpu", "--training.steps=10", "--training.seq_len=64", "--metrics.log_freq=5",
        "--optimizer.lr=3e-3", "--lr_scheduler.warmup_steps=2", "--metrics.enable_tensorboard=false"],
        env={"TITANLIKE_LOG_LEVEL": "DEBUG"}).stdout  # the TP plan is logged at debug level
    losses = [float(line.split(" loss ")[1].split()[0]) for line in out.splitlines() if " loss " in line]
    assert len(losses) == 3 and losses[-1] < losses[0] - 1.0, out
    assert "mesh DeviceMesh((tp=2)" in out and "layers.*.attention.wq" in out, out
