"""The model contract beyond next-token decoders, one process: the typed Batch (models/batch.py), the masked-LM
objective's deterministic masks, and frozen parameters in the memory estimate (the toy vision family of
tests/toy_family, registered for the test only). Training under FSDP: tests/multiproc/test_dist_model_contract.py."""
from __future__ import annotations

import pytest
import torch

from models.batch import IGNORE_INDEX, Batch, MaskedLM, NextToken, StepContext, build_objective
from tests.launch import REPO_ROOT


def test_next_token_batch_is_the_loader_batch():
    x, y = torch.arange(12).view(2, 6), torch.arange(1, 13).view(2, 6)
    b = NextToken()(x, y, StepContext(step=3, seed=0))
    assert b.args() == (x,) and b.kwargs() == {} and b.labels is y and b.sequence == ("tokens", "labels")
    halves = b.replace(inputs={"tokens": x, "doc_ids": x + 1}).split(2)
    assert [h.inputs["doc_ids"].tolist() for h in halves] == [[list(range(1, 7))], [list(range(7, 13))]]
    assert torch.equal(halves[1].labels, y[1:]) and halves[1].primary == "tokens"


def test_masked_lm_masks_depend_on_rows_step_and_seed_only():
    """The same row gets the same mask wherever it sits in the batch (any data-parallel layout, accumulation) and on
    a resume (same step, same seed); another step or seed masks other positions; ~15% masked, targets only there."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 1000, (8, 64), generator=g)
    mlm = MaskedLM(mask_id=1023)
    whole = mlm(x, x, StepContext(step=5, seed=0))
    flipped = mlm(x.flip(0), x, StepContext(step=5, seed=0))
    assert torch.equal(flipped.labels, whole.labels.flip(0))
    assert torch.equal(mlm(x[3:5], x, StepContext(5, 0)).labels, whole.labels[3:5])
    masked = whole.labels != IGNORE_INDEX
    assert 0.10 < masked.float().mean().item() < 0.20
    assert torch.equal(whole.labels[masked], x[masked]) and (whole.inputs["tokens"][masked] == 1023).all()
    assert torch.equal(whole.inputs["tokens"][~masked], x[~masked])
    for other in (StepContext(6, 0), StepContext(5, 1)):
        assert not torch.equal(mlm(x, x, other).labels, whole.labels)
    assert build_objective("masked_lm", type("A", (), {"vocab_size": 512})()).mask_id == 511
    with pytest.raises(ValueError, match=r"^ModelSpec.objective='nope' unknown; choose one of \['masked_lm', "):
        build_objective("nope", None)


@pytest.fixture
def toy_vision(monkeypatch):
    import models

    monkeypatch.syspath_prepend(str(REPO_ROOT / "tests" / "toy_family"))
    import toy_vision

    monkeypatch.setitem(models.MODELS, "toy_vision", toy_vision.SPEC)
    return toy_vision


def _vision_cfg(tmp_path, world: int):
    from titanlike.config.load import config_from_dict
    from titanlike.config.validate import validate

    cfg = config_from_dict({
        "job": {"dump_folder": str(tmp_path)}, "model": {"name": "toy_vision", "flavor": "tiny"},
        "training": {"steps": 2, "seq_len": 32, "local_batch_size": 2, "device": "cpu"},
        "data": {"dataset": "stdlib", "tokenizer": "builtin"}, "metrics": {"enable_tensorboard": False},
        "parallelism": {"dp_shard": -1}})
    validate(cfg, world)
    return cfg


@pytest.mark.parametrize("world", [1, 2])
def test_memory_estimate_counts_no_gradient_or_optimizer_state_for_frozen_parameters(tmp_path, toy_vision, world):
    """The traced step (titanlike/planner/step.py) of the vision model, whose patch projection is frozen: gradients
    are the trainable parameters' bytes only, the optimizer state two AdamW moments of them (+ a step counter
    each); under FSDP on 2 fake ranks, rank 0's dim-0 shards of the same."""
    from titanlike.planner import estimate_memory

    with torch.device("meta"):
        model = toy_vision.ToyVision(toy_vision.SPEC.flavors["tiny"])

    def local_bytes(p):  # rank 0's FSDP chunk (dim 0 padded to equal chunks), fp32
        return -(-p.shape[0] // world) * (p.numel() // p.shape[0]) * 4

    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    assert len(trainable) < len(params)  # the projection's weight and bias are frozen
    (r,) = estimate_memory(_vision_cfg(tmp_path, world), world, device_kind="cpu").ranks
    assert r.parameters == sum(local_bytes(p) for p in params)
    assert r.gradients == sum(local_bytes(p) for p in trainable)
    steps = r.optimizer_states - 2 * r.gradients
    assert 0 <= steps <= 8 * len(trainable), (r.optimizer_states, r.gradients)  # AdamW's step counters


def test_documents_come_from_the_loader_ids_not_the_objectives_inputs():
    """Masked-LM may put its mask id on an end-of-document token: the documents are found in the loader's ids. A
    batch without token ids (images) or with per-sequence labels refuses the document options in one line."""
    from types import SimpleNamespace

    from models.common.masks import document_ids
    from titanlike.config.sections import Data
    from titanlike.train.batch import BatchLayout

    eod = 0
    x = torch.tensor([[5, 6, eod, 7, 8, eod, 9, 4] * 4])
    mlm = MaskedLM(mask_id=99, rate=0.5)
    batch = mlm(x, x, StepContext(step=0, seed=0))
    assert (batch.inputs["tokens"] == 99).logical_and(x == eod).any()  # an EOD masked: the ids differ there
    no_mesh = SimpleNamespace(get_mesh=lambda _: None)
    got = BatchLayout(no_mesh, Data(document_masking=True), eod)(batch, x)
    assert torch.equal(got.inputs["doc_ids"], document_ids(x, eod)) and got.inputs["tokens"] is batch.inputs["tokens"]
    images = Batch({"pixels": torch.zeros(1, 3, 8, 8)}, torch.tensor([3]), primary="pixels", sequence=())
    with pytest.raises(ValueError, match=r"^data.document_masking .* this objective's batch has none \(inputs "
                                         r"\['pixels'\]\): turn them off for this model$"):
        BatchLayout(no_mesh, Data(document_masking=True), eod)(images)
    with pytest.raises(ValueError, match=r"^data.eod_mask_loss drops per-token targets, and this objective's labels "
                                         r"are \(1,\) for tokens \(1, 32\): turn it off for this model$"):
        BatchLayout(no_mesh, Data(eod_mask_loss=True), eod)(images, x)
