"""titanlike/observe/profiling.py: traces land on multiples of profile_freq (also after a resume), the trainer wires it,
and the config rejects a schedule longer than its period."""
from __future__ import annotations

import pytest
import torch

from titanlike.config import ConfigError
from titanlike.config.load import config_from_dict
from titanlike.config.validate import validate
from titanlike.observe.profiling import StepProfiler


def _cfg(**kw):
    return config_from_dict({"profiling": {"enable_profiling": True, **kw}}).profiling


@pytest.mark.parametrize("start_step", [0, 3])
def test_traces_end_on_multiples_of_freq(tmp_path, start_step):
    prof = StepProfiler(_cfg(profile_freq=2, profile_warmup=0, profile_active=1), str(tmp_path), rank=0,
                        device=torch.device("cpu"), start_step=start_step)
    x = torch.randn(16, 16)
    for step in range(start_step + 1, 7):
        x = (x @ x).tanh()
        prof.step(step)
    prof.stop()
    folders = sorted(p.name for p in (tmp_path / "profile_traces").iterdir())
    assert folders == [f"iteration_{s}" for s in (2, 4, 6) if s > start_step], folders
    for name in folders:
        trace = tmp_path / "profile_traces" / name / "rank0_trace.json"
        assert trace.stat().st_size > 0 and "aten::mm" in (trace.parent / "rank0_ops.txt").read_text()


def test_trainer_writes_traces(tmp_path):
    from titanlike.train.trainer import Trainer

    cfg = config_from_dict({
        "job": {"dump_folder": str(tmp_path), "run_name": "prof"}, "model": {"flavor": "debugmodel", "vocab_size": 256},
        "training": {"steps": 4, "seq_len": 32, "local_batch_size": 2, "device": "cpu"}, "data": {"dataset": "mock"},
        "lr_scheduler": {"warmup_steps": 1}, "metrics": {"log_freq": 2, "enable_tensorboard": False},
        "profiling": {"enable_profiling": True, "profile_freq": 4, "profile_warmup": 1, "profile_active": 1,
                      "enable_memory_snapshot": True}})  # snapshot: CUDA only, a warning on CPU
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    assert (tmp_path / "prof" / "profile_traces" / "iteration_4" / "rank0_trace.json").is_file()


def test_schedule_longer_than_period_is_rejected():
    cfg = config_from_dict({"profiling": {"enable_profiling": True, "profile_freq": 3, "profile_warmup": 3}})
    with pytest.raises(ConfigError, match="profile_warmup"):
        validate(cfg)


def test_kernel_breakdown_on_a_synthetic_trace():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "kernel_breakdown.py"
    spec = importlib.util.spec_from_file_location("kernel_breakdown", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    events = [  # two steps of 100 us each
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#4", "ts": 100, "dur": 100},
        # the GPU-side copies of the same annotations: not extra steps
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#3", "ts": 0, "dur": 80},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#4", "ts": 100, "dur": 90},
        {"ph": "X", "cat": "kernel", "name": "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "ts": 0, "dur": 60},
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_e4m3bf16_e4m3f32", "ts": 100, "dur": 40},
        {"ph": "X", "cat": "kernel", "name": "pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>", "ts": 60,
         "dur": 20},
        {"ph": "X", "cat": "kernel", "name": "triton_red_fused__to_copy_mean_mul_pow_rsqrt_0", "ts": 140, "dur": 20},
        {"ph": "X", "cat": "kernel", "name": "void at::native::(anonymous)::multi_tensor_apply_kernel<FusedAdam>",
         "ts": 160, "dur": 20},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL", "ts": 10, "dur": 30},  # overlapped
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "ts": 180, "dur": 5},
        {"ph": "X", "cat": "kernel", "name": "void at::native::vectorized_elementwise_kernel<4>", "ts": 185, "dur": 5},
    ]
    r = tool.breakdown(events)
    assert r["steps"] == 2 and r["window_ms"] * 1e3 == pytest.approx(100)
    per_step_us = {k: v * 1e3 for k, v in r["classes"].items()}
    assert per_step_us == pytest.approx({"gemm": 50, "attention": 10, "triton": 10, "optimizer": 10, "nccl": 15,
                                         "copy": 2.5, "other": 2.5})
    assert r["idle_ms"] * 1e3 == pytest.approx(15)  # nothing ran in 80..100 and 190..200: 30 us over 2 steps
    assert r["kernels"][0][1] == "gemm"
    assert [g[:2] for g in r["gaps"]] == [(0.02, 0.08), (0.01, 0.19)]  # (ms idle, ms into the window), longest first
