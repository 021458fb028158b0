"""Validation of the encoder families in the training loop (titanlike/train/evaluate.py): the objective's own
metrics (BERT: MLM loss, MLM accuracy, sentence-order accuracy; T5: decoder token accuracy), against a hand
computation on a fixed tiny batch and, in the loop, on Megatron's BERT / T5 data's held-out split."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import models
from models.batch import IGNORE_INDEX, Batch, build_objective
from tests.unit.masked_data_helpers import preprocess
from titanlike.config.load import config_from_dict
from titanlike.train.trainer import Trainer

torch.set_num_threads(1)
X = IGNORE_INDEX


def _objective(name: str, **args):
    """The family's objective as the trainer builds it (ModelSpec.objective for the debug flavor's args)."""
    spec = models.get_spec(name)
    flavor = dataclasses.replace(spec.flavor_args("debugmodel", args or None), vocab_size=256, max_seq_len=8)
    return build_objective(spec.objective, flavor)


def test_bert_metrics_equal_a_hand_count():
    """2 rows x 3 positions, vocabulary 4: the masked positions (labels != -100) whose argmax is the label, over
    the masked positions; the sentence-order label (last column) against the binary head's argmax."""
    logits = torch.tensor([[[5., 0, 0, 0], [0, 5, 0, 0], [0, 0, 5, 0]],
                           [[0, 0, 0, 5], [5, 0, 0, 0], [0, 5, 0, 0]]])
    binary = torch.tensor([[2., 1], [0, 3]])  # argmax 0, 1
    labels = torch.tensor([[0, X, 1, 1],   # masked 0 (right), 2 (argmax 2, label 1: wrong); order label 1 (wrong)
                           [3, 1, X, 1]])  # masked 0 (right), 1 (argmax 0, label 1: wrong); order label 1 (right)
    obj = _objective("bert", binary_head=True)
    out = obj.eval_metrics((logits, binary), Batch(inputs={}, labels=labels))
    ratio = {k: (s / c).item() for k, (s, c) in out.items()}
    assert ratio["mlm_accuracy"] == 2 / 4
    assert ratio["sop_accuracy"] == 1 / 2
    mlm = F.cross_entropy(logits.flatten(0, 1), labels[:, :3].flatten(), ignore_index=X)
    assert ratio["mlm_loss"] == pytest.approx(mlm.item(), rel=1e-6)
    # plain token data (labels [B, S], no order label): no sentence-order accuracy
    plain = obj.eval_metrics(logits, Batch(inputs={}, labels=labels[:, :3]))
    assert set(plain) == {"mlm_loss", "mlm_accuracy"} and (plain["mlm_accuracy"][0] / plain["mlm_accuracy"][1]) == 0.5


def test_t5_token_accuracy_equals_a_hand_count():
    logits = torch.tensor([[[0., 9, 0], [9, 0, 0], [0, 0, 9]], [[0, 0, 9], [0, 9, 0], [9, 0, 0]]])
    labels = torch.tensor([[1, 1, X], [2, 0, 0]])  # right, wrong, -; right, wrong, right
    obj = _objective("t5")
    (s, c), = obj.eval_metrics(logits, Batch(inputs={}, labels=labels)).values()
    assert (s.item(), c.item()) == (3, 5)


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    return preprocess(tmp_path_factory.mktemp("encoder_validation"))


def _cfg(tmp_path, prefix, family: str):
    model = ({"name": "bert", "flavor": "debugmodel", "args": {"binary_head": True, "mask_token_id": 5}}
             if family == "bert" else {"name": "t5", "flavor": "debugmodel"})
    return config_from_dict({
        "job": {"dump_folder": str(tmp_path), "run_name": family},
        "model": model,
        "training": {"steps": 2, "seq_len": 48, "local_batch_size": 4, "device": "cpu", "gc_freq": 0},
        "data": {"dataset": family, "paths": [prefix], "tokenizer_type": "BertWordPieceLowerCase",
                 "vocab_file": prefix.rsplit("/", 1)[0] + "/vocab.txt", "vocab_extra_ids": 100,
                 "decoder_seq_length": 16, "binary_head": family == "bert", "split": "80,20,0"},
        "optimizer": {"lr": 1e-3},
        "lr_scheduler": {"warmup_steps": 1},
        "metrics": {"log_freq": 1, "enable_tensorboard": False},
        "validation": {"enable": True, "interval": 2, "steps": 2},
    })


@pytest.mark.parametrize("family", ["bert", "t5"])
def test_validation_in_the_loop_logs_the_objectives_metrics(tmp_path, prefix, family, caplog):
    """A run validates on the held-out split (data.split's valid documents) and logs the family's metrics beside the
    loss; they equal a hand computation over the same validation batches with the trained weights."""
    trainer = Trainer(_cfg(tmp_path, prefix, family))
    try:
        with caplog.at_level("INFO", logger="titanlike"):
            trainer.train()
        got = trainer.last_validation
        trainer.model.eval()
        hits = total = loss = sop_hits = sops = 0
        with torch.no_grad():
            for _, (ids, labels) in zip(range(2), trainer.val_loader):
                batch = trainer.make_batch(ids, labels, step=0)
                out = trainer.model(*batch.args(), **batch.kwargs())
                logits = out[0] if isinstance(out, tuple) else out
                y = batch.labels[:, :logits.shape[1]]
                hits += ((logits.argmax(-1) == y) & (y != X)).sum().item()
                total += (y != X).sum().item()
                loss += F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=X, reduction="sum").item()
                if isinstance(out, tuple):
                    sop_hits += (out[1].argmax(-1) == batch.labels[:, -1]).sum().item()
                    sops += batch.labels.shape[0]
    finally:
        trainer.close()
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("validate step"))
    if family == "bert":
        assert set(got) == {"loss", "mlm_loss", "mlm_accuracy", "sop_accuracy"}
        assert got["mlm_accuracy"] == pytest.approx(hits / total, abs=1e-9)
        assert got["sop_accuracy"] == pytest.approx(sop_hits / sops, abs=1e-9)
        assert got["mlm_loss"] == pytest.approx(loss / total, rel=1e-5)
        assert got["loss"] > got["mlm_loss"]  # + the sentence-order term
        assert "mlm_accuracy" in line and "sop_accuracy" in line
    else:
        assert set(got) == {"loss", "token_accuracy"}
        assert got["token_accuracy"] == pytest.approx(hits / total, abs=1e-9)
        assert got["loss"] == pytest.approx(loss / total, rel=1e-5)
        assert "token_accuracy" in line
