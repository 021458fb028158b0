"""FSDP2 / HSDP parity with a single-process reference, plus mesh layouts; one torchrun launch per world size.

The checks themselves live in fsdp_worker.py (see its docstring); each asserts inside the workers.
"""

from pathlib import Path

import pytest

from tests.launch import run_torchrun

WORKER = Path(__file__).with_name("fsdp_worker.py")

EXPECTED = {
    2: ["mesh{}", "fsdp2_default_plan_sac_op", "fsdp2_fsdp_only_reshard_never", "fsdp2_qwen3_next_sac_op",
        "replicate2_default_plan_ac_full"],  # Muon cases: test_dist_muon.py
    4: ["mesh{'dp_replicate': 2}", "mesh{'dp_shard': 2, 'cp': 2}", "hsdp_2x2_default_plan_sac_2", "fsdp4_fsdp_only"],
}


@pytest.mark.dist
@pytest.mark.parametrize("nproc", [2, 4])
def test_fsdp_parity_and_meshes(nproc):
    out = run_torchrun(WORKER, nproc, timeout=180).stdout
    assert "ALL CHECKS PASSED" in out, out
    passed = [line[len("CHECK "):] for line in out.splitlines() if line.startswith("CHECK ")]
    for name in EXPECTED[nproc]:
        assert any(p.startswith(f"{name} ok") for p in passed), f"check {name!r} did not pass:\n{out}"
