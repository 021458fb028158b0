"""The FSDP parity worker on 2 GPUs with NCCL (fp32 tight; bf16 + compile + SAC loose). Skipped without 2 GPUs."""

from pathlib import Path

import pytest
import torch

from tests.launch import run_torchrun

WORKER = Path(__file__).with_name("fsdp_worker.py")


@pytest.mark.gpu
@pytest.mark.dist
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_fsdp_parity_on_gpus():
    out = run_torchrun(WORKER, 2, args=["--device=cuda"], timeout=300).stdout
    assert "ALL CHECKS PASSED" in out, out
    for name in ("cuda_fsdp2_fp32_sac_op", "cuda_fsdp2_bf16_compile_sac_op"):
        assert f"CHECK {name} ok" in out, out
