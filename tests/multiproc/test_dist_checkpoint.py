"""Checkpoints across processes and layouts, with the real Trainer (checkpoint_worker.py does the torchrun side).

- seed checkpoint (1 process) -> FSDP 2 and 1-process runs start from identical weights: same loss every step
- exact resume: FSDP 2 run stopped after step 4 (async pinned-memory saves), resumed in fresh processes -> the
  loss of every step equals the uninterrupted run's exactly
- resharding: FSDP 2 step 4 -> 1 process, -> TP 2, -> FSDP 2 x TP 2, and PP 2 step 4 -> FSDP 2: training
  continues with the uninterrupted run's loss. Every layout always runs: a regression fails, nothing skips.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from checkpoint_worker import a_step4, make_cfg, seed_path
from tests.launch import run_torchrun
from titanlike.checkpoint import complete_steps

WORKER = Path(__file__).with_name("checkpoint_worker.py")
TOL = 1e-5  # FSDP vs one process in fp32 (different reduction order); resume in one layout must be exact


def _single(root: str, name: str, **ckpt) -> tuple[dict[int, float], list[dict]]:
    """A 1-process run (local batch 4 = FSDP 2's global batch) in this process: losses, checkpoint stats."""
    from titanlike.train.trainer import Trainer

    trainer = Trainer(make_cfg(root, name, local_batch=4, deterministic=False, checkpoint=ckpt))
    try:
        return {h["step"]: h["loss"] for h in trainer.train()}, trainer.checkpointer.stats
    finally:
        trainer.close()


def _losses(run: dict) -> dict[int, float]:
    return {int(k): v for k, v in run["losses"].items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    from titanlike.train.trainer import Trainer

    # another init seed than the runs' own: a run that failed to load the seed would show it in its loss
    seed = Trainer(make_cfg(root, "seed", deterministic=False, seed=1, checkpoint={"create_seed_checkpoint": True}))
    try:
        seed.checkpointer.save_seed()
    finally:
        seed.close()
    env = {"CKPT_TEST_TP": "1", "CKPT_TEST_PP": "1"}  # the worker's TP and PP runs: always on
    run_torchrun(WORKER, 2, args=[root, "first"], timeout=240, env=env)
    run_torchrun(WORKER, 2, args=[root, "resume"], timeout=240, env=env)
    run_torchrun(WORKER, 4, args=[root, "tp4"], timeout=240, env=env)
    out = {}
    for phase in ("first", "resume", "tp4"):
        path = os.path.join(root, f"{phase}.json")
        if os.path.exists(path):
            with open(path) as f:
                out.update({f"{phase}.{k}": v for k, v in json.load(f).items()})
    return root, out


@pytest.mark.dist
def test_seed_checkpoint_gives_fsdp_and_single_process_the_same_run(runs):
    root, out = runs
    assert complete_steps(seed_path(root)) == [0]
    fsdp = _losses(out["first.A"])
    single, stats = _single(root, "C", enable=False, initial_load_path=seed_path(root))
    seed_load = {"load_step": 0, "full": False}
    assert any(seed_load.items() <= s.items() for s in stats) and not any("step" in s for s in stats)  # no saves
    assert any(seed_load.items() <= s.items() for s in out["first.A"]["stats"])
    assert sorted(fsdp) == sorted(single) == list(range(1, 7))
    for step in fsdp:
        assert single[step] == pytest.approx(fsdp[step], abs=TOL), step


@pytest.mark.dist
def test_exact_resume_after_stopping(runs):
    root, out = runs
    full, first, resumed = _losses(out["first.A"]), _losses(out["first.B"]), _losses(out["resume.B"])
    assert sorted(first) == [1, 2, 3, 4] and sorted(resumed) == [5, 6], (first, resumed)
    for step, loss in {**first, **resumed}.items():
        assert loss == full[step], f"step {step}: {loss} vs uninterrupted {full[step]}"  # bitwise
    # keep_latest_k=1: only the newest complete step survives; async saves were committed and timed
    assert complete_steps(os.path.join(root, "B", "checkpoint")) == [6]
    stats = out["first.B"]["stats"]
    assert [s.get("step") for s in stats if "step" in s] == [2, 4]
    assert all(s["mode"] == "async_with_pinned_mem" and s["stall_s"] >= 0 for s in stats if "step" in s)
    assert any(s.get("load_step") == 4 and s["full"] for s in out["resume.B"]["stats"])


@pytest.mark.dist
def test_reshard_fsdp2_to_one_process(runs):
    root, out = runs
    full = _losses(out["first.A"])
    assert os.path.isdir(a_step4(root))
    resumed, _ = _single(root, "D", initial_load_path=a_step4(root), initial_load_model_only=False)
    assert sorted(resumed) == [5, 6], resumed
    for step, loss in resumed.items():
        assert loss == pytest.approx(full[step], abs=TOL), step


@pytest.mark.dist
@pytest.mark.parametrize("layout", ["resume.TP2", "tp4.FSDP2xTP2", "resume.PP2toFSDP2"])
def test_reshard_across_layouts(runs, layout):
    _, out = runs
    assert layout in out, f"{layout}: the worker wrote no run for it (phases present: {sorted(out)})"
    full, resumed = _losses(out["first.A"]), _losses(out[layout])
    if layout == "resume.PP2toFSDP2":  # the pipeline run that wrote the checkpoint tracked FSDP 2 too
        for step, loss in _losses(out["first.PP2"]).items():
            assert loss == pytest.approx(full[step], abs=TOL), ("PP2", step)
    assert sorted(resumed) == [5, 6], resumed
    for step, loss in resumed.items():
        assert loss == pytest.approx(full[step], abs=TOL), (layout, step)


def teardown_module(module):
    torch.use_deterministic_algorithms(False)
