"""float8 and the chunked loss on CUDA (marked `gpu`, skipped on CPU): run on the GPU machine with
`python -m pytest -q tests/gpu/test_gpu_float8.py` (1 GPU; the last test needs 2)."""
import pytest
import torch

from tests.launch import REPO_ROOT, run_torchrun
from titanlike.config.load import load_config
from titanlike.train.trainer import Trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _losses(tmp_path, *extra) -> list[float]:
    cfg = load_config(["--config", str(REPO_ROOT / "configs/debug_model.toml"), f"--job.dump_folder={tmp_path}",
                       "--training.device=cuda", "--metrics.log_freq=5", "--training.steps=40", "--compile.enable",
                       *extra])
    trainer = Trainer(cfg)
    try:
        return [h["loss"] for h in trainer.train()]
    finally:
        trainer.close()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_compile_tracks_bf16(tmp_path, recipe):
    """Per-block compile + float8 on the debug model: the loss curve stays within 3% of bf16's at every log step."""
    bf16 = _losses(tmp_path)
    fp8 = _losses(tmp_path, "--float8.enable", f"--float8.recipe={recipe}")
    assert fp8[-1] < fp8[0] - 1.0, fp8
    for a, b in zip(bf16, fp8):
        assert abs(a - b) / a < 0.03, (bf16, fp8)


def test_chunked_loss_on_cuda_matches_plain(tmp_path):
    """bf16 autocast + compiled chunk math: the chunked LM head + loss follows the plain compiled loss."""
    plain = _losses(tmp_path)
    chunked = _losses(tmp_path, "--training.loss_chunk_tokens=256")
    for a, b in zip(plain, chunked):
        assert abs(a - b) / a < 0.02, (plain, chunked)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fsdp_float8_all_gather_nccl(tmp_path):
    """torchrun on 2 GPUs: FSDP2 with float8 all-gather + precomputed scales, compile and selective AC: it learns."""
    out = run_torchrun(REPO_ROOT / "scripts/train.py", 2, timeout=300, args=[
        "--config", "configs/debug_model.toml", f"--job.dump_folder={tmp_path}", "--training.steps=30",
        "--training.device=cuda", "--compile.enable", "--activation_checkpoint.mode=selective", "--float8.enable",
        "--float8.enable_fsdp_float8_all_gather", "--float8.precompute_float8_dynamic_scale_for_fsdp"]).stdout
    losses = [float(line.split("loss")[1].split()[0]) for line in out.splitlines() if " loss " in line]
    assert len(losses) >= 2 and losses[-1] < losses[0] - 1.0, out
