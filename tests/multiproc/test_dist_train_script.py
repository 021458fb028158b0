"""scripts/train.py as users launch it, under torchrun on gloo: one short run per layout a user types, each of which
must learn. (The exact parity of these layouts with one process is checked by the worker-based tests beside this
file: test_dist_fsdp, test_dist_tp, test_dist_moe_layouts.) The TP runs only with TITANLIKE_TEST_FULL=1: TP's parity
with one process is test_dist_tp's and (qwen3's MoE) test_dist_cp's, scripts/train.py under TP test_dist_layouts'
(TP 2 x PP 2) and test_dist_moe_layouts' (TP 2 x FSDP 2 x EP 2), and the plan's description tests/unit/test_tp.py's."""
import pytest

from tests.launch import REPO_ROOT, full_matrix, run_torchrun

SCRIPT = str(REPO_ROOT / "scripts/train.py")
full_only = pytest.mark.skipif(not full_matrix(), reason="covered by the parity tests: set TITANLIKE_TEST_FULL=1")


def _losses(out: str) -> list[float]:
    return [float(line.split(" loss ")[1].split()[0]) for line in out.splitlines() if " loss " in line]


@pytest.mark.dist
def test_fsdp2_learns(tmp_path):
    out = run_torchrun(SCRIPT, 2, timeout=240, args=[
        "--config", "configs/debug_model.toml", f"--job.dump_folder={tmp_path}", "--training.steps=10",
        "--training.seq_len=64", "--training.device=cpu", "--activation_checkpoint.mode=selective",
        "--metrics.log_freq=5", "--metrics.enable_tensorboard=false"]).stdout
    losses = _losses(out)
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.5, out
    assert "mesh DeviceMesh((dp_shard=2)" in out


@pytest.mark.dist
@pytest.mark.slow
@full_only
def test_tp2_learns_and_logs_the_plan(tmp_path):
    """Tensor parallel 2 (sequence + loss parallel, the defaults)."""
    out = run_torchrun(SCRIPT, 2, timeout=240, args=[
        "--config", "configs/debug_model.toml", "--parallelism.tp", "2", f"--job.dump_folder={tmp_path}",
        "--training.device=cpu", "--training.steps=10", "--training.seq_len=64", "--metrics.log_freq=5",
        "--optimizer.lr=3e-3", "--lr_scheduler.warmup_steps=2", "--metrics.enable_tensorboard=false"],
        env={"TITANLIKE_LOG_LEVEL": "DEBUG"}).stdout  # the TP plan is logged at debug level
    losses = _losses(out)
    assert len(losses) == 3 and losses[-1] < losses[0] - 1.0, out
    assert "mesh DeviceMesh((tp=2)" in out and "layers.*.attention.wq" in out, out


@pytest.mark.dist
@pytest.mark.slow
@full_only
def test_tp2_moe_learns(tmp_path):
    """Tensor parallel 2 on an MoE model: the MoE blocks run replicated over TP (router and experts as replicated
    DTensors, q/k norms on sharded heads)."""
    out = run_torchrun(SCRIPT, 2, timeout=240, args=[
        "--config", "configs/qwen3_debug_moe.toml", "--parallelism.tp", "2", f"--job.dump_folder={tmp_path}",
        "--training.device=cpu", "--training.steps=6", "--training.seq_len=64", "--training.local_batch_size=4",
        "--model.n_layers=2", "--metrics.log_freq=1", "--optimizer.lr=3e-3", "--lr_scheduler.warmup_steps=2",
        "--metrics.enable_tensorboard=false"], env={"TITANLIKE_LOG_LEVEL": "DEBUG"}).stdout  # (the TP plan)
    losses = _losses(out)
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.2, out
    assert "layers.*.moe.router" in out and "layers.*.attention.q_norm" in out, out
