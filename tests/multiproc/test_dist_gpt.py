"""The GPT family under TP 2 (sequence and loss parallel on and off) and FSDP 2, tied and untied embeddings, against
one process (gloo, fp32, 1e-5: loss, gradients, parameters after 3 SGD steps). Checks in gpt_worker.py."""
from pathlib import Path

import pytest

from tests.launch import run_torchrun

WORKER = Path(__file__).with_name("gpt_worker.py")
EXPECTED = ["tp2_sp_lp_tied", "tp2_tied", "tp2_sp_untied", "fsdp2_tied", "fsdp2_untied"]


@pytest.mark.dist
def test_gpt_tp2_and_fsdp2_match_one_process():
    out = run_torchrun(WORKER, 2, timeout=180).stdout
    assert "ALL CHECKS PASSED" in out, out
    passed = [line[len("CHECK "):] for line in out.splitlines() if line.startswith("CHECK ")]
    for name in EXPECTED:
        assert any(p.startswith(f"{name} ok") for p in passed), f"check {name!r} did not pass:\n{out}"
