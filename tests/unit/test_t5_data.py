"""T5 data: T5Dataset's span corruption (layout, sentinels, decoder budget, determinism) and its statistics against
megatron-core's T5MaskedWordPieceDataset on the same sentence-split prefix."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.unit.masked_data_helpers import megatron_dataset, preprocess
from titanlike.data.indexed import IndexedDataset
from titanlike.data.t5_dataset import T5Dataset
from titanlike.data.tokenizers.bert_wordpiece import BertWordPieceTokenizer

N = 600


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    return preprocess(tmp_path_factory.mktemp("t5"))


@pytest.fixture(scope="module")
def tok(prefix):
    return BertWordPieceTokenizer(prefix.rsplit("/", 1)[0] + "/vocab.txt", vocab_extra_ids=100)


def _ours(prefix, tok, tmp_path, seq_len=128, **kw):
    ix = IndexedDataset(prefix)
    return T5Dataset(ix, (0, ix.num_documents), seq_len, tok, seed=1234, cache_dir=str(tmp_path), **kw)


def test_layout_and_sentinels(prefix, tok, tmp_path):
    ds = _ours(prefix, tok, tmp_path, seq_len=64, decoder_seq_length=32)
    for i in range(50):
        x, y = ds[i]
        s = ds.sample(i)
        assert x.shape == (2, 96) and y.shape == (96,)
        enc, dec, mask = x[0, :64].numpy(), x[0, 64:].numpy(), x[1].numpy()
        ne, nd = int(mask[:64].sum()), int(mask[64:].sum())
        assert (enc[:ne] == s["encoder"]).all() and (dec[:nd] == s["decoder_input"]).all()
        assert (y[:64] == -100).all() and (y[64 + nd :] == -100).all()
        assert y[64 : 64 + nd - 1].tolist() == dec[1:nd].tolist() and y[64 + nd - 1] == tok.eos_id
        k = len(s["spans"])
        sentinels = tok.sentinel_ids[:k]
        assert enc[np.isin(enc, tok.sentinel_ids)].tolist() == sentinels  # in order, one per span
        assert dec[0] == tok.bos_id and dec[np.isin(dec, tok.sentinel_ids)].tolist() == sentinels
        rebuilt, at = [], 0  # the encoder input with each sentinel put back to its span is the text
        for span, sentinel in zip(s["spans"], sentinels):
            rebuilt += s["tokens"][at : span[0]].tolist() + [sentinel]
            at = span[-1] + 1
        assert rebuilt + s["tokens"][at:].tolist() == s["encoder"].tolist()


def test_decoder_budget_is_kept(prefix, tok, tmp_path):
    ds = _ours(prefix, tok, tmp_path, seq_len=128, decoder_seq_length=12)
    assert max(ds.sample(i)["decoder_input"].size for i in range(200)) <= 12
    with pytest.raises(ValueError, match="raise data.vocab_extra_ids"):
        _ours(prefix, BertWordPieceTokenizer(tok.path, vocab_extra_ids=5), tmp_path)


def test_deterministic(prefix, tok, tmp_path):
    a, b = _ours(prefix, tok, tmp_path / "a"), _ours(prefix, tok, tmp_path / "b")
    for i in (0, 9, 4000):
        assert all(torch.equal(p, q) for p, q in zip(a[i], b[i]))
    c = _ours(prefix, tok, tmp_path / "c", mean_span_length=2.0)
    assert any(not torch.equal(a[i][0], c[i][0]) for i in range(5))


def _stats(encoders, decoders, sentinels):
    spans = np.array([np.isin(e, sentinels).sum() for e in encoders])
    dec = np.array([d.size for d in decoders])
    masked = dec - 1 - spans  # [BOS] + a sentinel per span + the masked tokens
    tokens = np.array([e.size for e in encoders]) - spans + masked
    return {"noise": masked.sum() / tokens.sum(), "spans": spans.mean(), "span_len": masked.sum() / spans.sum(),
            "enc_len": np.mean([e.size for e in encoders]), "dec_len": dec.mean(), "dec_max": dec.max()}


def test_statistics_match_megatron_core(prefix, tok, tmp_path):
    """pretrain_t5.py's settings: density 0.15, geometric spans p = 0.2 cut at 10 (our mean_span_length 5)."""
    theirs = megatron_dataset("t5", prefix, tok, 128, tmp_path / "m", num_samples=N)
    ms = [theirs[i] for i in range(N)]
    m = _stats([s["text_enc"][s["enc_mask"] == 1] for s in ms], [s["text_dec"][s["dec_mask"] == 1] for s in ms],
               tok.sentinel_ids)
    ours = _ours(prefix, tok, tmp_path)
    os_ = [ours.sample(i) for i in range(N)]
    o = _stats([s["encoder"] for s in os_], [s["decoder_input"] for s in os_], tok.sentinel_ids)
    print("megatron-core", m, "\ntitanlike", o)
    assert abs(o["noise"] - m["noise"]) < 0.006 and abs(o["noise"] - 0.15) < 0.01
    for key in ("spans", "span_len", "enc_len", "dec_len"):
        assert abs(o[key] - m[key]) < 0.08 * m[key], key
