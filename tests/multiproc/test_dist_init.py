"""Layout-independent initialisation (titanlike/distributed/seeded_init.py) through the real Trainer, no seed
checkpoint: every layout starts from the one-process run's weights, bitwise, and logs its step-1 loss.

One 4-rank launch (init_worker.py) builds, in turn:

  llama3 debug         HSDP 2 x 2 | TP 2 x FSDP 2 (_StridedShard) | PP 2 x TP 2 (1F1B) | CP 2 x FSDP 2
  deepseek_v3 debug    FSDP 4 x EP 2 | TP 2 x FSDP 2 x EP 2 | PP 2 x FSDP 2 x EP 2

and the references run here, in one process, with the same config. Each layout's full parameters (gathered from
every rank; ranks holding the same parameter must agree) are torch.equal to the reference's, and its step-1 loss is
within 1e-5 (fp32 on gloo: only the reduction order differs). The weights are drawn in 4096-element blocks, so FSDP
and EP ranks skip the blocks they do not hold, TP ranks keep columns, and FSDP over TP keeps interleaved rows.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from init_worker import BLOCK_NUMEL, RUNS, config, local_params
from tests.launch import run_torchrun

WORKER = Path(__file__).with_name("init_worker.py")
LOSS_TOL = 1e-5


def _one_process(root: str, family: str) -> tuple[dict[str, torch.Tensor], float]:
    from titanlike.train.trainer import Trainer

    trainer = Trainer(config(root, f"{family}_one", family, ["--training.local_batch_size=4"], 1))
    try:
        params = local_params(trainer)
        loss = trainer.train()[0]["loss"]
    finally:
        trainer.close()
    return params, loss


@pytest.mark.dist
def test_every_layout_starts_from_the_one_process_weights(tmp_path, monkeypatch):
    from titanlike.distributed import seeded_init

    root = str(tmp_path)
    run_torchrun(WORKER, 4, args=[root], timeout=300)
    monkeypatch.setattr(seeded_init, "BLOCK_NUMEL", BLOCK_NUMEL)
    refs = {family: _one_process(root, family) for family in {family for family, _ in RUNS.values()}}

    for name, (family, _) in RUNS.items():
        got = torch.load(os.path.join(root, f"{name}.pt"))
        ref_params, ref_loss = refs[family]
        assert sorted(got["params"]) == sorted(ref_params), name
        differ = [fqn for fqn, value in ref_params.items() if not torch.equal(got["params"][fqn], value)]
        assert not differ, (name, differ)
        assert abs(got["loss"] - ref_loss) <= LOSS_TOL, (name, got["loss"], ref_loss)
    # the MoE's stacked experts (EP's Shard(0) over experts) were drawn, not left as to_empty made them
    experts = [v for fqn, v in refs["deepseek_v3"][0].items() if fqn.endswith(("experts.w1", "experts.w2"))]
    assert experts and all(v.std() > 0 for v in experts)
