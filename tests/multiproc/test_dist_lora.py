"""LoRA under FSDP 2, TP 2 (with and without sequence/loss parallel, selective AC) and PP 2 equals one process
(gloo, fp32, 1e-5). One torchrun launch; the checks live in lora_worker.py: per step the loss, grad norm and adapter
gradients of the planned model against the one-process model, adapters after 3 AdamW steps, the base frozen and
bitwise unchanged, TP's adapter placements (parallelize/lora.py); then the Trainer under PP 2 and FSDP 2 (adapter-only
checkpoints, an exact resume), whose losses and grad norms this file holds to a one-process Trainer run."""
import json
from pathlib import Path

import pytest

from tests.launch import run_torchrun

WORKER = Path(__file__).with_name("lora_worker.py")
CASES = ["lora_fsdp2", "lora_tp2", "lora_tp2_sp_lp_sac", "lora_pp2_trainer", "lora_fsdp2_trainer_resume"]


@pytest.mark.dist
def test_lora_layouts_equal_one_process(tmp_path):
    out = run_torchrun(WORKER, 2, args=[str(tmp_path)], timeout=300).stdout
    assert "ALL CHECKS PASSED" in out, out
    passed = [line[len("CHECK "):] for line in out.splitlines() if line.startswith("CHECK ")]
    for name in CASES:
        assert any(p.startswith(f"{name} ok") for p in passed), f"check {name!r} did not pass:\n{out}"

    from lora_worker import train, trainer_cfg

    one = train(trainer_cfg(str(tmp_path), "one"))  # the same run in this process: world 1, no plan's sharding
    runs = json.loads((tmp_path / "trainers.json").read_text())
    for name, run in runs.items():
        assert [h["step"] for h in run] == [1, 2, 3, 4], (name, run)
        for h, r in zip(run, one):
            assert abs(h["loss"] - r["loss"]) <= 1e-5 and abs(h["grad_norm"] - r["grad_norm"]) <= 1e-5, (name, h, r)
