"""T5 trained on Megatron's T5 data: data.dataset = "t5" batches (spans corrupted by the data, the encoder and decoder
padding masks) through the family's objective (models/t5/objective.py) and the trainer's step, against a hand
computation; the sentinel and decoder-length refusals."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from models.batch import IGNORE_INDEX
from tests.unit.masked_data_helpers import preprocess
from titanlike.config.errors import ConfigError
from titanlike.config.load import config_from_dict
from titanlike.config.validate import validate
from titanlike.train.trainer import Trainer

torch.set_num_threads(1)
SE, SD = 48, 16


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    return preprocess(tmp_path_factory.mktemp("t5_pretrain"))


def cfg_of(tmp_path, prefix, *, args=None, **sections):
    base = {
        "job": {"dump_folder": str(tmp_path), "run_name": "run"},
        "model": {"name": "t5", "flavor": "debugmodel", "args": dict(args or {})},
        "training": {"steps": 4, "seq_len": SE, "local_batch_size": 4, "device": "cpu", "gc_freq": 0},
        "data": {"dataset": "t5", "paths": [prefix], "tokenizer_type": "BertWordPieceLowerCase",
                 "vocab_file": prefix.rsplit("/", 1)[0] + "/vocab.txt", "vocab_extra_ids": 100,
                 "decoder_seq_length": SD},
        "optimizer": {"lr": 1e-3},
        "lr_scheduler": {"warmup_steps": 1, "decay_type": "constant"},
        "metrics": {"log_freq": 1, "enable_tensorboard": False},
    }
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    return config_from_dict(base)


def test_one_step_loss_and_grads_match_a_hand_computation(tmp_path, prefix):
    """The trainer's step on one loader batch: the data's corrupted encoder tokens and decoder input as they are (no
    second corruption), both padding masks reach the forward, and loss = mean cross-entropy over the decoder targets
    (the trainer's own scale, 1 / Batch.target_count()): loss and every gradient equal autograd's on the
    hand-written loss (fp32)."""
    trainer = Trainer(cfg_of(tmp_path, prefix))
    try:
        ids, labels = next(iter(trainer.dataloader))
        assert ids.shape == (4, 2, SE + SD) and labels.shape == (4, SE + SD)
        reference = copy.deepcopy(trainer.model)
        batch = trainer.make_batch(ids, labels, step=1)
        assert torch.equal(batch.inputs["tokens"], ids[:, 0, :SE])  # the data corrupted: nothing drawn again
        assert torch.equal(batch.inputs["decoder_tokens"], ids[:, 0, SE:])
        enc_mask, dec_mask = ids[:, 1, :SE], ids[:, 1, SE:]
        assert (enc_mask == 0).any() and (dec_mask == 0).any()  # both padded somewhere: the masks matter
        sentinels = set(trainer.tokenizer.sentinel_ids)
        assert sentinels & set(ids[:, 0, :SE].flatten().tolist())  # the tokenizer's <extra_id_k> are in the input
        count = batch.target_count()
        targets = labels[:, SE:] != IGNORE_INDEX
        assert (labels[:, :SE] == IGNORE_INDEX).all() and int(count) == int(targets.sum()) > 0
        loss = trainer.compute.forward_backward(trainer.model, batch, 1.0 / count.float()) / count

        logits = reference(ids[:, 0, :SE], decoder_tokens=ids[:, 0, SE:], attention_mask=enc_mask,
                           decoder_attention_mask=dec_mask)
        want = F.cross_entropy(logits[targets], labels[:, SE:][targets])
        want.backward()
        assert float(loss) == pytest.approx(float(want), rel=1e-6), (float(loss), float(want))
        # Without the encoder mask the loss differs: the mask is what the model read.
        unmasked = reference(ids[:, 0, :SE], decoder_tokens=ids[:, 0, SE:])
        assert abs(float(F.cross_entropy(unmasked[targets], labels[:, SE:][targets])) - float(want)) > 1e-5
        grads = dict(trainer.model.named_parameters())
        checked = 0
        for name, p in reference.named_parameters():
            torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
            checked += 1
        assert checked > 20 and grads["tok_embeddings.weight"].grad.abs().sum() > 0
        print(f"loss {float(loss):.6f} = hand {float(want):.6f} over {checked} gradients, {int(count)} targets")
    finally:
        trainer.close()


def test_training_lowers_the_loss(tmp_path, prefix):
    trainer = Trainer(cfg_of(tmp_path, prefix, training={"steps": 8}, optimizer={"lr": 3e-3}))
    try:
        losses = [h["loss"] for h in trainer.train()]
    finally:
        trainer.close()
    assert all(x == x for x in losses) and losses[-1] < losses[0], losses


def test_sentinels_disagreeing_with_the_tokenizer_stop_at_start_up(tmp_path, prefix):
    with pytest.raises(ConfigError) as e:
        Trainer(cfg_of(tmp_path, prefix, args={"n_sentinels": 50}))
    (line,) = str(e.value).splitlines()
    assert "model.args.sentinel_top" in line and "n_sentinels=100" in line and "data.vocab_extra_ids" in line, line


@pytest.mark.parametrize("sd,args,fix", [(20, {}, "model.args.decoder_multiple"),
                                         (64, {"max_decoder_len": 32}, "model.args.max_decoder_len")])
def test_decoder_length_refusals_are_one_line(tmp_path, prefix, sd, args, fix):
    cfg = cfg_of(tmp_path, prefix, args=args, data={"decoder_seq_length": sd})
    with pytest.raises(ConfigError) as e:
        validate(cfg, 1)
    (line,) = [ln for ln in str(e.value).splitlines() if "decoder_seq_length" in ln]
    assert fix in line, line
