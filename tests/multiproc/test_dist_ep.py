"""Expert parallelism on gloo: EP 4, EP 2 x expert FSDP 2 (eager, and compiled with per-op selective AC) and HSDP 2 x
EP 2 on four processes equal the one-process reference (losses, every gradient, the balancing biases; ep_worker.py),
and the EP checkpoint reloads into one process exactly."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.launch import full_matrix, run_torchrun

WORKER = Path(__file__).with_name("ep_worker.py")
# "compile": the blocks compiled (parallelize/compile.py) under per-op selective AC, still equal to the reference.
# EP 2 x expert FSDP 2 eager (the same layout as ep=2:compile; eager in test_dist_init.py, test_dist_cp.py and
# test_dist_lora.py's SFT) with TITANLIKE_TEST_FULL=1 only. The last layout saves the checkpoint reloaded here.
LAYOUTS = ["ep=4", *(["ep=2"] if full_matrix() else []), "ep=2:compile", "dp_replicate=2:ep=2"]


@pytest.mark.dist
def test_expert_parallel_matches_one_process_and_reshards(tmp_path):
    out = run_torchrun(WORKER, 4, args=[str(tmp_path)], timeout=240, env={"LAYOUTS": ",".join(LAYOUTS)}).stdout
    assert "ALL CHECKS PASSED" in out, out
    for layout in LAYOUTS:
        assert f"CHECK {layout} ok" in out, out

    from ep_worker import model  # tests/multiproc is on sys.path (its conftest)
    one = model(seed=1)  # different weights: the load must overwrite every tensor
    state = {"model": one.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(tmp_path, "ckpt"), no_dist=True)
    one.load_state_dict(state["model"])
    expected = torch.load(tmp_path / "full_state.pt")
    got = one.state_dict()
    assert set(expected) <= set(got)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


@pytest.mark.dist
def test_expert_parallel_with_token_dropping_matches_fsdp(tmp_path):
    # A capacity factor below the load drops assignments on every rank; EP must drop and combine exactly as FSDP.
    out = run_torchrun(WORKER, 2, args=[str(tmp_path)], timeout=180, env={"LAYOUTS": "ep=2", "CAPACITY": "0.6"}).stdout
    assert "CHECK ep=2 ok" in out and "ALL CHECKS PASSED" in out, out
