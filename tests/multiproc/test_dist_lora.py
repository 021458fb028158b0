"""LoRA and supervised fine-tuning under the parallel layouts equal one process (gloo, fp32). Two torchrun launches:

lora_worker.py (2 ranks): LoRA under FSDP 2, TP 2 (with and without sequence/loss parallel, selective AC): per step
the loss, grad norm and adapter gradients of the planned model against the one-process model, adapters after 3 AdamW
steps, the base frozen and bitwise unchanged, TP's adapter placements (parallelize/lora.py); then the Trainer under PP
2 and FSDP 2 (adapter-only checkpoints, an exact resume), whose losses and grad norms this file holds to a one-process
Trainer run; then sft_worker.py's 2-rank supervised fine-tuning runs.

sft_worker.py (4 ranks): its 4-rank runs. Supervised fine-tuning (chat data, assistant-only labels, packed with
document masking), full and LoRA, dense Llama and Qwen3 MoE (LoRA on the routed experts too) under FSDP 2, TP 2, PP 2,
CP 2, EP 2 (2 ranks) and HSDP 2x2, CP 2 x FSDP 2, EP 2 x CP 2 (4 ranks), each held here to its one-process run."""
import json
from pathlib import Path

import pytest

from tests.launch import run_torchrun

WORKER = Path(__file__).with_name("lora_worker.py")
SFT_WORKER = Path(__file__).with_name("sft_worker.py")
CASES = ["lora_fsdp2", "lora_tp2", "lora_tp2_sp_lp_sac", "lora_pp2_trainer", "lora_fsdp2_trainer_resume",
         "sft_layouts_2"]


def _same_runs(runs: dict, references: dict, steps: int, loss_tol: float, norm_tol: float, rel: bool) -> None:
    """Every run of `runs` ({name: history}) equals its reference (`references[name]`, a history) step by step."""
    for name, run in runs.items():
        ref = references[name]
        assert [h["step"] for h in run] == list(range(1, steps + 1)), (name, run)
        for h, r in zip(run, ref):
            scale = (lambda v: abs(v)) if rel else (lambda v: 1.0)
            assert abs(h["loss"] - r["loss"]) <= loss_tol * scale(r["loss"]), (name, h, r)
            assert abs(h["grad_norm"] - r["grad_norm"]) <= norm_tol * scale(r["grad_norm"]), (name, h, r)


@pytest.mark.dist
def test_lora_and_sft_layouts_equal_one_process(tmp_path):
    out = run_torchrun(WORKER, 2, args=[str(tmp_path)], timeout=300).stdout
    out4 = run_torchrun(SFT_WORKER, 4, args=[str(tmp_path)], timeout=300).stdout
    assert "ALL CHECKS PASSED" in out and "ALL CHECKS PASSED" in out4, out + out4
    passed = [line[len("CHECK "):] for line in (out + out4).splitlines() if line.startswith("CHECK ")]
    for name in [*CASES, "sft_layouts_4"]:
        assert any(p.startswith(f"{name} ok") for p in passed), f"check {name!r} did not pass:\n{out}\n{out4}"

    from lora_worker import trainer_cfg
    from sft_worker import REFERENCES, RUNS, sft_cfg, train

    # LoRA on mock data: absolute 1e-5 on loss and grad norm (only the adapters train).
    one = train(trainer_cfg(str(tmp_path), "one"))  # the same run in this process: world 1, no plan's sharding
    runs = json.loads((tmp_path / "trainers.json").read_text())
    _same_runs(runs, {name: one for name in runs}, 4, 1e-5, 1e-5, rel=False)

    # SFT: the Trainer-level tolerances of tests/multiproc/test_dist_model_contract.py (loss rel 1e-5, grad norm rel
    # 1e-4): every parameter trains (full SFT), each layout sums the fp32 gradient norm in another order; seen: loss
    # within 2e-7, grad norm within 2.3e-5 (relative).
    refs = {ref: train(sft_cfg(str(tmp_path), f"one_{ref}", **kw)) for ref, kw in REFERENCES.items()}
    for world, layouts in RUNS.items():
        runs = json.loads((tmp_path / f"sft_{world}.json").read_text())
        assert sorted(runs) == sorted(layouts), (world, sorted(runs))
        _same_runs(runs, {name: refs[layouts[name][0]] for name in runs}, 3, 1e-5, 1e-4, rel=True)
    for ref in ("dense", "moe"):  # and full SFT learns
        assert refs[ref][-1]["loss"] < refs[ref][0]["loss"] - 1, refs[ref]
