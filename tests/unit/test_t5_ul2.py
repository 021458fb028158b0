"""UL2's mixture of denoisers on Megatron's T5 data (data.t5_denoisers = "ul2", titanlike/data/t5_dataset.py): each
denoiser's statistics over a few hundred samples, the mode tokens, determinism, the one-line refusals, and a T5 debug
run that trains on it."""
from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import torch

from tests.unit.masked_data_helpers import preprocess
from titanlike.config.errors import ConfigError
from titanlike.config.load import config_from_dict
from titanlike.config.sections import Data
from titanlike.data.indexed import IndexedDataset
from titanlike.data.t5_dataset import T5Dataset, ul2_mixture
from titanlike.data.tokenizers.bert_wordpiece import BertWordPieceTokenizer
from titanlike.train.trainer import Trainer

torch.set_num_threads(1)
# R (regular), S (prefix LM), X (long spans), X (dense)
MIX = dict(t5_denoisers="ul2", ul2_kinds=["R", "S", "X", "X"], ul2_mean_span_lengths=[3.0, 0.0, 32.0, 3.0],
           ul2_noise_densities=[0.15, 0.25, 0.5, 0.5], ul2_probabilities=[0.4, 0.2, 0.2, 0.2])


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    """The shared sentence-split corpus, with a vocab.txt that ends in the mode tokens (appended: text ids stay)."""
    folder = tmp_path_factory.mktemp("ul2")
    p = preprocess(folder)
    shutil.copy(folder / "vocab.txt", folder / "vocab_plain.txt")
    with open(folder / "vocab.txt", "a") as f:
        f.write("[R]\n[S]\n[X]\n")
    return p


def _vocab(prefix, name="vocab.txt"):
    return prefix.rsplit("/", 1)[0] + "/" + name


def _dataset(prefix, tmp_path, seed=1234, seq_len=160, **mix):
    tok = BertWordPieceTokenizer(_vocab(prefix), vocab_extra_ids=100)
    cfg = dataclasses.replace(Data(), vocab_file=_vocab(prefix), **{**MIX, **mix})
    denoisers, probs = ul2_mixture(cfg, tok)
    ix = IndexedDataset(prefix)
    return T5Dataset(ix, (0, ix.num_documents), seq_len, tok, decoder_seq_length=seq_len, seed=seed,
                     cache_dir=str(tmp_path), denoisers=denoisers, probabilities=probs), tok


def test_each_denoisers_statistics(prefix, tmp_path):
    ds, tok = _dataset(prefix, tmp_path)
    modes = [tok.token_to_id(t) for t in ("[R]", "[S]", "[X]")]
    stats = {k: {"n": 0, "noise": [], "spans": [], "suffix": []} for k in range(4)}
    for i in range(400):
        s = ds.sample(i)
        k, tokens, spans = s["denoiser"], s["tokens"], s["spans"]
        st = stats[k]
        st["n"] += 1
        assert s["encoder"][0] == modes["RSX".index("RSXX"[k])]  # the mode token first
        if k == 1:  # S: the encoder reads a prefix, the decoder predicts exactly the rest
            cut = tokens.size - (s["decoder_target"].size - 1)
            assert s["encoder"][1:].tolist() == tokens[:cut].tolist()
            assert s["decoder_target"][:-1].tolist() == tokens[cut:].tolist() and s["decoder_target"][-1] == tok.eos_id
            assert s["decoder_input"][0] == tok.bos_id and not np.isin(s["encoder"], tok.sentinel_ids).any()
            st["suffix"].append((tokens.size - cut) / tokens.size)
        else:
            st["noise"].append(sum(len(x) for x in spans) / tokens.size)
            st["spans"] += [len(x) for x in spans]
    share = {k: v["n"] / 400 for k, v in stats.items()}
    noise = {k: float(np.mean(v["noise"])) for k, v in stats.items() if v["noise"]}
    span = {k: float(np.mean(v["spans"])) for k, v in stats.items() if v["spans"]}
    suffix = float(np.mean(stats[1]["suffix"]))
    print(f"share {share} noise {noise} mean span {span} S suffix share {suffix}")
    for k, p in enumerate(MIX["ul2_probabilities"]):
        assert abs(share[k] - p) < 0.07, share
    assert abs(noise[0] - 0.15) < 0.03 and abs(span[0] - 3) < 0.8  # R
    assert abs(noise[3] - 0.5) < 0.06 and abs(span[3] - 3) < 0.8  # X dense
    assert abs(noise[2] - 0.5) < 0.06 and span[2] > 3 * span[0]  # X long (the rows' budget shortens 32)
    assert abs(suffix - 0.25) < 0.06  # S


def test_deterministic_and_seeded(prefix, tmp_path):
    a, _ = _dataset(prefix, tmp_path / "a")
    b, _ = _dataset(prefix, tmp_path / "b")
    c, _ = _dataset(prefix, tmp_path / "c", seed=7)
    for i in (0, 5, 333):
        assert all(torch.equal(p, q) for p, q in zip(a[i], b[i]))  # any process, any order: sample i is fixed
    assert [b.sample(i)["denoiser"] for i in (333, 0, 5)] == [a.sample(i)["denoiser"] for i in (333, 0, 5)]
    assert any(not torch.equal(a[i][0], c[i][0]) for i in range(5))


def _cfg(tmp_path, prefix, vocab="vocab.txt", steps=8, **data):
    return config_from_dict({
        "job": {"dump_folder": str(tmp_path), "run_name": "ul2"},
        "model": {"name": "t5", "flavor": "debugmodel"},
        "training": {"steps": steps, "seq_len": 48, "local_batch_size": 4, "device": "cpu", "gc_freq": 0},
        "data": {"dataset": "t5", "paths": [prefix], "tokenizer_type": "BertWordPieceLowerCase",
                 "vocab_file": _vocab(prefix, vocab), "vocab_extra_ids": 100, "decoder_seq_length": 32,
                 **{k: v for k, v in MIX.items()}, **data},
        "optimizer": {"lr": 3e-3},
        "lr_scheduler": {"warmup_steps": 1, "decay_type": "constant"},
        "metrics": {"log_freq": 1, "enable_tensorboard": False},
    })


def test_bad_mixtures_are_refused_in_one_line(tmp_path, prefix):
    with pytest.raises(ConfigError) as e:
        from titanlike.config.validate import validate

        validate(_cfg(tmp_path, prefix, ul2_probabilities=[0.5, 0.5, 0.5, 0.5]))
    msg = str(e.value)
    assert "data.ul2_probabilities=[0.5, 0.5, 0.5, 0.5] sum to 2" in msg and "adding up to 1" in msg
    with pytest.raises(ValueError, match=r"mode token \[R\], which the vocabulary .* lacks: append the lines") as e:
        Trainer(_cfg(tmp_path, prefix, vocab="vocab_plain.txt"))
    assert "\n" not in str(e.value)


def test_t5_debug_run_trains_on_ul2(tmp_path, prefix):
    trainer = Trainer(_cfg(tmp_path, prefix))
    try:
        losses = [h["loss"] for h in trainer.train()]
    finally:
        trainer.close()
    print("losses", [round(x, 3) for x in losses])
    assert all(x == x for x in losses) and np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.3, losses
