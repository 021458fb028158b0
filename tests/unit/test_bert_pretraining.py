"""BERT trained as Megatron's pretrain_bert.py does: data.dataset = "bert" batches (masked tokens, token types, padding
mask; MLM targets + the sentence-order label) through the family's objective (models/bert/objective.py) and the
trainer's loss normalisation, against a hand computation; the binary head's refusals."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import models
from titanlike.train.batch import per_sample_scale
from models.batch import IGNORE_INDEX, StepContext, build_objective
from tests.unit.masked_data_helpers import preprocess
from titanlike.config.errors import ConfigError
from titanlike.config.load import config_from_dict
from titanlike.config.validate import validate
from titanlike.train.trainer import Trainer

torch.set_num_threads(1)
SPEC = models.get_spec("bert")
SEQ = 48


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    return preprocess(tmp_path_factory.mktemp("bert_pretrain"))


def cfg_of(tmp_path, prefix, *, binary: bool = True, dataset: str = "bert", **sections):
    base = {
        "job": {"dump_folder": str(tmp_path), "run_name": "run"},
        "model": {"name": "bert", "flavor": "debugmodel", "args": {"binary_head": binary, "mask_token_id": 5}},
        "training": {"steps": 4, "seq_len": SEQ, "local_batch_size": 4, "device": "cpu", "gc_freq": 0},
        "data": {"dataset": dataset, "paths": [prefix], "tokenizer_type": "BertWordPieceLowerCase",
                 "vocab_file": prefix.rsplit("/", 1)[0] + "/vocab.txt", "vocab_extra_ids": 100, "binary_head": binary},
        "optimizer": {"lr": 1e-3},
        "lr_scheduler": {"warmup_steps": 1, "decay_type": "constant"},
        "metrics": {"log_freq": 1, "enable_tensorboard": False},
    }
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    return config_from_dict(base)


@pytest.mark.parametrize("binary", [True, False])
def test_one_step_loss_and_grads_match_a_hand_computation(tmp_path, prefix, binary):
    """The trainer's step on one loader batch: inputs are the data's masked tokens as they are (no second mask), the
    token types and padding mask reach the forward, and loss = MLM mean over the masked tokens (+ SOP mean over the
    samples with the binary head), with the trainer's own scale (1 / Batch.target_count()): loss and every gradient
    equal autograd's on the hand-written loss (fp32)."""
    trainer = Trainer(cfg_of(tmp_path, prefix, binary=binary))
    try:
        ids, labels = next(iter(trainer.dataloader))
        assert ids.shape == (4, 3, SEQ) and labels.shape == (4, SEQ + 1)
        reference = copy.deepcopy(trainer.model)
        batch = trainer.make_batch(ids, labels, step=1)
        assert torch.equal(batch.inputs["tokens"], ids[:, 0])  # the data masked: nothing drawn again
        assert torch.equal(batch.inputs["token_types"], ids[:, 1]) and torch.equal(batch.inputs["attention_mask"],
                                                                                   ids[:, 2])
        count = batch.target_count()
        masked = labels[:, :SEQ] != IGNORE_INDEX
        assert int(count) == int(masked.sum()) > 0  # the normaliser counts masked tokens, not the order labels
        loss = trainer.compute.forward_backward(trainer.model, batch, 1.0 / count.float()) / count

        out = reference(ids[:, 0], token_types=ids[:, 1], attention_mask=ids[:, 2])
        logits, sop_logits = out if binary else (out, None)
        want = F.cross_entropy(logits[masked], labels[:, :SEQ][masked])
        if binary:
            assert set(labels[:, SEQ].tolist()) <= {0, 1}
            want = want + F.cross_entropy(sop_logits, labels[:, SEQ])
        else:
            assert (labels[:, SEQ] == IGNORE_INDEX).all()
        want.backward()
        assert float(loss) == pytest.approx(float(want), rel=1e-6), (float(loss), float(want))
        grads = dict(trainer.model.named_parameters())
        checked = 0
        for name, p in reference.named_parameters():
            torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
            checked += 1
        assert binary == ("binary.weight" in grads) and grads["tok_embeddings.weight"].grad.abs().sum() > 0
        print(f"binary={binary}: loss {float(loss):.6f} = hand {float(want):.6f} over {checked} gradients")
    finally:
        trainer.close()


def test_training_lowers_the_loss(tmp_path, prefix):
    trainer = Trainer(cfg_of(tmp_path, prefix, training={"steps": 8}, optimizer={"lr": 3e-3}))
    try:
        losses = [h["loss"] for h in trainer.train()]
    finally:
        trainer.close()
    assert all(map(lambda x: x == x, losses)) and losses[-1] < losses[0], losses


def test_sentence_order_is_a_mean_over_the_steps_samples_however_the_rows_are_cut():
    """MLM mean over the step's masked tokens + SOP mean over its samples, whether the rows arrive as one micro-batch
    or as pieces of other sizes (micro-batches, data ranks: per_sample_scale sums both counts over all of them; a
    pipeline's cut of a micro-batch keeps its aux_scale), with uneven masked counts per row."""
    args = dataclasses.replace(SPEC.flavors["debugmodel"], vocab_size=50, binary_head=True)
    obj = build_objective(SPEC.objective, args)
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randint(6, 50, (4, 12), generator=g), torch.zeros(4, 12, dtype=torch.long),
                       torch.ones(4, 12, dtype=torch.long)], dim=1)
    labels = torch.full((4, 13), IGNORE_INDEX)
    for row, n in enumerate((1, 2, 4, 5)):  # uneven masked counts per row
        labels[row, :n] = 7
    labels[:, 12] = torch.tensor([0, 1, 1, 0])
    logits, binary = torch.randn(4, 12, 50, generator=g), torch.randn(4, 2, generator=g)
    masked = labels[:, :12] != -100
    expected = float(F.cross_entropy(logits[masked], labels[:, :12][masked]) + F.cross_entropy(binary, labels[:, 12]))
    for cut in ((4,), (1, 3), (3, 1), (2, 2)):  # rows per micro-batch (or per rank: the sum is the same)
        starts = [sum(cut[:i]) for i in range(len(cut))]
        batches = [obj(ids[a:a + n], labels[a:a + n], StepContext(0, 0)) for a, n in zip(starts, cut)]
        batches, targets = per_sample_scale(batches, lambda x: x)
        assert int(targets) == 12
        total = sum(obj.loss((logits[a:a + n], binary[a:a + n]), b.labels, **b.extras)
                    for a, n, b in zip(starts, cut, batches))
        assert float(total / targets) == pytest.approx(expected, rel=1e-6), cut
        if len(cut) == 1:  # a pipeline's cut of one micro-batch: the pieces keep the step's scale
            halves = batches[0].split(2)
            parts = sum(obj.loss((logits[i:i + 2], binary[i:i + 2]), h.labels, **h.extras)
                        for i, h in zip((0, 2), halves))
            torch.testing.assert_close(parts, total)


def test_binary_head_refusals_are_one_line(tmp_path, prefix):
    """The head trains only where the data draws its label: plain token data, or data.binary_head against
    model.args.binary_head disagreeing, stop at config load, one line naming both keys."""
    cases = {("stdlib", True, None): "data.dataset=\"bert\"",
             ("bert", True, False): "data.binary_head=false",
             ("bert", False, True): "model.args.binary_head=false"}
    for (dataset, model_head, data_head), fix in cases.items():
        cfg = cfg_of(tmp_path, prefix, binary=model_head, dataset=dataset)
        if dataset == "stdlib":
            cfg.data.paths, cfg.data.tokenizer_type, cfg.data.vocab_file = [], "auto", ""
            cfg.data.tokenizer = "builtin"
        else:
            cfg.data.binary_head = data_head
        with pytest.raises(ConfigError) as e:
            validate(cfg, 1)
        (line,) = [ln for ln in str(e.value).splitlines() if "binary_head" in ln]
        assert fix in line and "model.args.binary_head" in line, line
    validate(cfg_of(tmp_path, prefix, binary=True), 1)  # both on: trains
    validate(cfg_of(tmp_path, prefix, binary=False), 1)
