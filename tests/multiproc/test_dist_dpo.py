"""DPO on two gloo processes equals one process: FSDP 2 (precomputed and frozen-copy references), TP 2, PP 2 (1F1B
with the precomputed reference, with LoRA, with the frozen copy; ZBVZeroBubble) and CP 2 (precomputed, LoRA, frozen
copy) give the one-process gradients, losses, reward metrics, weights and reference table (fp32, 1e-5); so do packed
rows of pairs (data.preference_layout="pack") under FSDP 2 (both references), TP 2, PP 2 and CP 2 against the
one-process packed run. One torchrun launch (dpo_worker.py). By default it runs a subset that still has packing on
every layout, both references, LoRA (through the pipeline) and ZBV; TITANLIKE_TEST_FULL=1 adds FULL_ONLY."""
from pathlib import Path

import pytest
import torch

from tests.launch import full_matrix, run_torchrun
from tests.multiproc.dpo_worker import make_cfg, record
from tests.unit.test_dpo_train import write_pairs

WORKER = Path(__file__).with_name("dpo_worker.py")
TOL = dict(atol=1e-5, rtol=1e-5)

# run name: (a substring of its mesh, the one-process run it equals)
RUNS = {"fsdp2": ("dp_shard=2", "one"), "fsdp2_frozen": ("dp_shard=2", "one"), "tp2": ("tp=2", "one"),
        "pp2": ("pp=2", "one"), "pp2_lora": ("pp=2", "one_lora"), "pp2_frozen": ("pp=2", "one"),
        "pp2_zbv": ("pp=2", "one"), "cp2": ("cp=2", "one"), "cp2_lora": ("cp=2", "one_lora"),
        "cp2_frozen": ("cp=2", "one"), "fsdp2_pack": ("dp_shard=2", "one_pack"),
        "fsdp2_pack_frozen": ("dp_shard=2", "one_pack"), "tp2_pack": ("tp=2", "one_pack"),
        "pp2_pack": ("pp=2", "one_pack"), "cp2_pack": ("cp=2", "one_pack")}
# Repeats of paths the default runs cover: the frozen copy under FSDP (fsdp2_pack_frozen) and CP (cp2_frozen); the
# precomputed reference on plain rows under FSDP (fsdp2), on packed rows (tp2_pack, pp2_pack, cp2_pack) and through the
# pipeline (pp2_zbv, pp2_lora); LoRA under CP (pp2_lora: the adapters split over stages).
FULL_ONLY = ("fsdp2_frozen", "fsdp2_pack", "tp2", "pp2", "cp2", "cp2_lora")
TABLES = ("fsdp2", "tp2", "pp2", "pp2_lora", "pp2_zbv", "cp2", "cp2_lora",  # the precomputed runs
          "fsdp2_pack", "tp2_pack", "pp2_pack", "cp2_pack")


def _same(run: dict, ref: dict, name: str) -> None:
    assert run["count"] == ref["count"], name  # the global count is pairs, not tokens (nor packed rows)
    assert run["grads"].keys() == ref["grads"].keys(), name  # (under PP: every stage's, joined)
    for k, g in ref["grads"].items():
        torch.testing.assert_close(run["grads"][k], g, **TOL, msg=lambda m: f"{name} grad {k}: {m}")
    losses = [h["loss"] for h in run["history"]]
    assert losses == pytest.approx([h["loss"] for h in ref["history"]], abs=1e-5), name
    for key in ("grad_norm", "dpo/reward_accuracy", "dpo/reward_margin", "dpo/chosen_reward", "dpo/rejected_reward"):
        assert [h[key] for h in run["history"]] == pytest.approx([h[key] for h in ref["history"]], abs=1e-5), \
            (name, key)
    for k, w in ref["weights"].items():
        torch.testing.assert_close(run["weights"][k], w, **TOL, msg=lambda m: f"{name} weight {k}: {m}")


@pytest.mark.dist
def test_dpo_on_every_layout_equals_one_process(tmp_path):
    pairs = write_pairs(tmp_path / "pairs.jsonl", n=12)
    names = [name for name in RUNS if full_matrix() or name not in FULL_ONLY]
    out = run_torchrun(WORKER, 2, args=[str(tmp_path), pairs, ",".join(names)], timeout=600).stdout
    refs = {"one": record(make_cfg(str(tmp_path), pairs, "one")),
            "one_lora": record(make_cfg(str(tmp_path), pairs, "one_lora", lora=True)),
            "one_pack": record(make_cfg(str(tmp_path), pairs, "one_pack", packed=True))}
    assert refs["one"]["count"] == 4.0 and refs["one_pack"]["count"] > 4.0  # 4 pairs; 4 rows of several pairs
    for ref in refs.values():
        assert ref["history"][0]["loss"] == pytest.approx(0.6931472, abs=1e-6)
        assert ref["history"][-1]["dpo/reward_accuracy"] > 0  # (the metrics compared below move)
    for name in names:
        mesh, ref_name = RUNS[name]
        assert f"RUN {name} done" in out, out
        run = torch.load(tmp_path / f"{name}.pt", weights_only=False)
        assert mesh in run["mesh"] and run["loss_parallel"] == name.startswith("tp2"), run["mesh"]
        _same(run, refs[ref_name], name)
    # the pass split over the data ranks (FSDP), on sharded logits (TP), through the pipeline (PP), on each rank's
    # chunks of every sequence (CP)
    for name in (n for n in TABLES if n in names):
        ref = refs[RUNS[name][1]]["table"]
        table = torch.load(tmp_path / f"{name}.pt", weights_only=False)["table"]
        assert (table["keys"] == ref["keys"]).all(), name
        torch.testing.assert_close(torch.from_numpy(table["values"]), torch.from_numpy(ref["values"]), **TOL,
                                   msg=lambda m: f"{name} table: {m}")
