"""DPO on two gloo processes equals one process: FSDP 2 (precomputed and frozen-copy references) and TP 2 give the
one-process gradients, losses, weights and reference table (fp32, 1e-5). One torchrun launch (dpo_worker.py)."""
from pathlib import Path

import pytest
import torch

from tests.launch import run_torchrun
from tests.multiproc.dpo_worker import make_cfg, record
from tests.unit.test_dpo_train import write_pairs

WORKER = Path(__file__).with_name("dpo_worker.py")
TOL = dict(atol=1e-5, rtol=1e-5)


def _same(run: dict, ref: dict, name: str) -> None:
    assert run["count"] == ref["count"] == 4.0, name  # the global count is pairs, not tokens
    for k, g in ref["grads"].items():
        torch.testing.assert_close(run["grads"][k], g, **TOL, msg=lambda m: f"{name} grad {k}: {m}")
    losses = [h["loss"] for h in run["history"]]
    assert losses == pytest.approx([h["loss"] for h in ref["history"]], abs=1e-5), name
    for key in ("dpo/reward_accuracy", "dpo/reward_margin"):
        assert [h[key] for h in run["history"]] == pytest.approx([h[key] for h in ref["history"]], abs=1e-5), name
    for k, w in ref["weights"].items():
        torch.testing.assert_close(run["weights"][k], w, **TOL, msg=lambda m: f"{name} weight {k}: {m}")


@pytest.mark.dist
def test_dpo_fsdp2_and_tp2_equal_one_process(tmp_path):
    pairs = write_pairs(tmp_path / "pairs.jsonl", n=12)
    out = run_torchrun(WORKER, 2, args=[str(tmp_path), pairs], timeout=300).stdout
    ref = record(make_cfg(str(tmp_path), pairs, "one"))
    assert ref["history"][0]["loss"] == pytest.approx(0.6931472, abs=1e-6)
    for name, mesh in (("fsdp2", "dp_shard=2"), ("fsdp2_frozen", "dp_shard=2"), ("tp2", "tp=2")):
        assert f"RUN {name} done" in out, out
        run = torch.load(tmp_path / f"{name}.pt", weights_only=False)
        assert mesh in run["mesh"] and run["loss_parallel"] == (name == "tp2"), run["mesh"]
        _same(run, ref, name)
    for name in ("fsdp2", "tp2"):  # the pass split over the data ranks (FSDP) or run on sharded logits (TP)
        table = torch.load(tmp_path / f"{name}.pt", weights_only=False)["table"]
        assert (table["keys"] == ref["table"]["keys"]).all(), name
        torch.testing.assert_close(torch.from_numpy(table["values"]), torch.from_numpy(ref["table"]["values"]),
                                   **TOL)
