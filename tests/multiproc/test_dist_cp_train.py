"""Context parallel through the real Trainer (cp_train_worker.py), all from one seed checkpoint, fp32 on gloo:

  one, one_docs   1 process, without and with data.document_masking        the references (in this process)
  cp2pp2          4 ranks   CP 2 x PP 2 (1F1B, 2 micro-batches)            = one
  cp2pp2_docs     4 ranks   the same with document masking: the document ids go through the pipeline schedule to
                            every stage (and through the forward-only validation pass)   = one_docs
  cp2pp2_docs_ring, _a2a    the same by parallelism.cp_method "ring" and "alltoall"     = one_docs
  cp2dp2          4 ranks   CP 2 x FSDP 2, full checkpoint half-way         = one
  resume_one      1 process from cp2dp2's checkpoint                         second half = cp2dp2
  resume_fsdp2    2 ranks   FSDP 2 from cp2dp2's checkpoint                  second half = cp2dp2

cp2pp2, cp2pp2_docs_ring and resume_fsdp2 run with TITANLIKE_TEST_FULL=1 only (cp_train_worker.FULL_ONLY).

Losses of every step (Trainer.train()'s float history, not the log's decimals) and the validation losses within 1e-5
(fp32, another reduction order: the tolerance of the other layout tests); gradient norms within 3e-4 relative:
torch's fp32 norm on the CPU sums a tensor's squares with an error that grows with its size (the 2048 x 256 output
gradient's norm is 1.5e-4 below its float64 value in one process) and each FSDP/CP sharding splits the sum
differently, while the gradients themselves agree within 4e-8 (checked parameter by parameter).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cp_train_worker import HALF, STEPS, config, default_runs
from tests.launch import run_torchrun

WORKER = Path(__file__).with_name("cp_train_worker.py")
TOL, NORM_RTOL = 1e-5, 3e-4


def _one_process(root: str, name: str, extra: list[str]) -> dict:
    from titanlike.train.trainer import Trainer

    trainer = Trainer(config(root, name, ["--training.local_batch_size=4", *extra], 1))
    validations = []
    validate = trainer.validate
    trainer.validate = lambda: validations.append(validate()) or validations[-1]
    try:
        if name == "seed":
            trainer.checkpointer.save_seed()
            return {}
        history = trainer.train()
    finally:
        trainer.close()
    return json.loads(json.dumps({"loss": {h["step"]: h["loss"] for h in history},
                                  "grad_norm": {h["step"]: h["grad_norm"] for h in history},
                                  "validation": validations}))  # the workers' JSON keys (str steps)


def _worst(a: dict, b: dict, steps) -> tuple[float, float]:
    """(largest loss difference, largest relative gradient-norm difference) over `steps`."""
    return (max(abs(a["loss"][str(s)] - b["loss"][str(s)]) for s in steps),
            max(abs(a["grad_norm"][str(s)] / b["grad_norm"][str(s)] - 1) for s in steps))


@pytest.mark.dist
@pytest.mark.slow
def test_context_parallel_trainer_pipeline_and_resharding(tmp_path):
    root = str(tmp_path)
    _one_process(root, "seed", [])
    run_torchrun(WORKER, 4, args=[root, "pp"], timeout=420)
    if "resume_fsdp2" in default_runs():
        run_torchrun(WORKER, 2, args=[root, "fsdp2"], timeout=240)
    runs = {name: json.load(open(os.path.join(root, f"{name}.json"))) for name in default_runs()}
    one = _one_process(root, "one", [])
    one_docs = _one_process(root, "one_docs", ["--data.document_masking=true"])
    resume_one = _one_process(root, "resume_one", [])

    full, tail = range(1, STEPS + 1), range(HALF + 1, STEPS + 1)
    assert one["loss"] != one_docs["loss"]  # the documents change the attention: the two references differ
    refs = {"cp2pp2": one, "cp2pp2_docs": one_docs, "cp2pp2_docs_ring": one_docs, "cp2pp2_docs_a2a": one_docs,
            "cp2dp2": one}
    checks = {name: (got, refs[name], full) for name, got in runs.items() if name in refs}
    resumed = {"resume_one": resume_one, **{name: runs[name] for name in ("resume_fsdp2",) if name in runs}}
    checks |= {name: (got, runs["cp2dp2"], tail) for name, got in resumed.items()}
    for name, (got, ref, span) in checks.items():
        assert sorted(map(int, got["loss"])) == list(span), (name, got["loss"])
        loss_diff, norm_diff = _worst(got, ref, span)
        assert loss_diff <= TOL and norm_diff <= NORM_RTOL, (name, loss_diff, norm_diff, got, ref)
        # Validation after HALF and at the end (a resumed run: at the end only)
        assert len(got["validation"]) == len(span) // HALF, (name, got["validation"])
        for v, r in zip(reversed(got["validation"]), reversed(ref["validation"])):
            assert abs(v - r) <= TOL, (name, got["validation"], ref["validation"])
    assert one["loss"][str(STEPS)] < one["loss"]["1"], one  # and it learns
