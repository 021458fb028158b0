"""float8 + FSDP2 (all-gather off/on, precomputed scales, rowwise), the chunked loss under FSDP2, and torchao's
float8 TP styles, on 2 gloo processes in one torchrun launch (checks in float8_worker.py)."""
from pathlib import Path

import pytest

from tests.launch import run_torchrun

WORKER = Path(__file__).with_name("float8_worker.py")
EXPECTED = ["fsdp_float8_tensorwise", "fsdp_float8_tensorwise_allgather", "fsdp_float8_tensorwise_allgather_precompute",
            "fsdp_float8_rowwise", "fsdp_chunked_loss", "tp_float8_styles", "tp_plan_float8_tensorwise"]


@pytest.mark.dist
def test_float8_fsdp_tp_and_chunked_loss():
    out = run_torchrun(WORKER, 2, timeout=180).stdout
    assert "ALL CHECKS PASSED" in out, out
    passed = {line.split()[1] for line in out.splitlines() if line.startswith("CHECK ") and " ok" in line}
    missing = [name for name in EXPECTED if name not in passed]
    assert not missing, f"checks {missing} did not pass:\n{out}"
