"""Muon under FSDP / HSDP / TP / EP against one process, and the bytes its owner path moves: muon_worker.py."""
from pathlib import Path

import pytest

from tests.launch import run_torchrun

WORKER = Path(__file__).with_name("muon_worker.py")

EXPECTED = {
    2: ["fsdp2_muon_owner", "fsdp2_muon_replicated", "tp2_sp_lp_muon"],
    4: ["fsdp4_muon_owner", "fsdp4_muon_bytes", "hsdp_2x2_muon_owner", "fsdp2_tp2_sp_lp_muon",
        "nemotron_h_moe_tp2_fsdp2_ep2_muon"],
}


@pytest.mark.dist
@pytest.mark.parametrize("nproc", [2, 4])
def test_muon_sharded(nproc):
    out = run_torchrun(WORKER, nproc, timeout=300).stdout
    assert "ALL CHECKS PASSED" in out, out
    passed = [line[len("CHECK "):] for line in out.splitlines() if line.startswith("CHECK ")]
    for name in EXPECTED[nproc]:
        assert any(p.startswith(f"{name} ok") for p in passed), f"check {name!r} did not pass:\n{out}"
