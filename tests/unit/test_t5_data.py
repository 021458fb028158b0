"""T5 data: T5Dataset's span corruption (layout, sentinels, decoder budget, determinism, loader resume, a T5
sentencepiece model's sentinels against transformers) and its statistics against
megatron-core's T5MaskedWordPieceDataset on the same sentence-split prefix."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.unit.masked_data_helpers import megatron_dataset, preprocess, resumed_batches
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


def test_loader_resumes_mid_epoch(prefix, tok, tmp_path):
    """The loader's state after 3 batches, restored into a fresh loader, gives the uninterrupted loader's next two
    batches exactly."""
    from titanlike.config.sections import Data

    cfg = Data(dataset="t5", paths=[prefix], split="100,0,0", tokenizer_type="BertWordPieceLowerCase",
               vocab_file=str(tok.path), vocab_extra_ids=100, decoder_seq_length=16, cache_dir=str(tmp_path))
    want, got, fresh = resumed_batches(cfg, tok, skip=3, take=2)
    assert want[0][0].shape == (4, 2, 80) and want[0][1].shape == (4, 80)
    for g, w in zip(got, want):
        assert torch.equal(g[0], w[0]) and torch.equal(g[1], w[1])
    assert not torch.equal(want[0][0], fresh[0][0])  # not a restart


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


@pytest.fixture(scope="module")
def spiece(tmp_path_factory):
    """A tiny T5-style sentencepiece model (unigram; pad 0, eos 1, unk 2, no BOS, as T5's spiece.model) trained on
    the test corpus, and that corpus preprocessed with it and 20 sentinels."""
    import json

    from tests.unit.masked_data_helpers import preprocess_main, write_corpus

    spm = pytest.importorskip("sentencepiece")
    d = tmp_path_factory.mktemp("t5spm")
    write_corpus(d / "docs.jsonl", docs=200)
    texts = [json.loads(line)["text"] for line in open(d / "docs.jsonl")]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_prefix=str(d / "spiece"), vocab_size=120,
                                   pad_id=0, eos_id=1, unk_id=2, bos_id=-1, minloglevel=2)
    assert preprocess_main([str(a) for a in ("--input", d / "docs.jsonl", "--output-prefix", d / "c",
                                             "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                                             d / "spiece.model", "--vocab-extra-ids", "20", "--split-sentences",
                                             "--sentence-splitter", "rules", "--no-progress")]) == 0
    return d / "spiece.model", str(d / "c_text_sentence")


def test_sentencepiece_sentinels_match_transformers(spiece, tmp_path):
    """T5's spiece.model convention: <extra_id_0> is the last id; text ids and sentinel ids equal transformers'
    T5Tokenizer built from the same model, and Megatron-style T5 samples build from it."""
    import shutil

    from transformers import T5Tokenizer

    from titanlike.config.sections import Data
    from titanlike.data.tokenizers import build_tokenizer

    model, prefix = spiece
    tok = build_tokenizer(Data(tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(model),
                               vocab_extra_ids=20))
    shutil.copy(model, tmp_path / "spiece.model")
    hf = T5Tokenizer.from_pretrained(str(tmp_path), extra_ids=20)
    assert tok.vocab_size == len(hf) == 140
    names = [f"<extra_id_{k}>" for k in range(20)]
    assert tok.sentinel_ids == hf.convert_tokens_to_ids(names) == list(range(139, 119, -1))
    assert [tok.token_to_id(n) for n in names] == tok.sentinel_ids and tok.id_to_token(139) == "<extra_id_0>"
    text = "The quick foxes jumped over the lazy dog, singing in green trees!"
    assert tok.encode(text) == hf(text, add_special_tokens=False).input_ids
    assert (tok.pad_id, tok.eos_id, tok.decoder_start_id) == (hf.pad_token_id, hf.eos_token_id, 0)
    ids = tok.encode("a cat") + [tok.sentinel_ids[0]] + tok.encode("sings")
    assert tok.decode(ids) == hf.decode(ids) == "a cat<extra_id_0> sings"
    assert not tok.continuation[tok.sentinel_ids].any() and tok.continuation.sum() > 0
    assert build_tokenizer(Data(tokenizer_model=str(model))).sentinel_ids == []  # no extras unless asked
    from titanlike.checkpoint.hf_tokenizer import sentencepiece_to_hf

    exported = sentencepiece_to_hf(tok, add_bos=False)  # what an HF export writes as tokenizer.json
    assert [exported.token_to_id(n) for n in names] == tok.sentinel_ids and exported.get_vocab_size() == 140

    ix = IndexedDataset(prefix)
    ds = T5Dataset(ix, (0, ix.num_documents), 64, tok, decoder_seq_length=32, seed=3, cache_dir=str(tmp_path))
    for i in range(20):
        x, y = ds[i]
        s = ds.sample(i)
        k = len(s["spans"])
        enc, dec = x[0, :64].numpy(), x[0, 64:].numpy()
        assert k > 0 and enc[np.isin(enc, tok.sentinel_ids)].tolist() == tok.sentinel_ids[:k]
        assert dec[0] == hf.pad_token_id and dec[np.isin(dec, tok.sentinel_ids)].tolist() == tok.sentinel_ids[:k]
        assert y[64 : 64 + len(s["decoder_target"])].tolist() == s["decoder_target"].tolist()
        assert s["decoder_target"][-1] == hf.eos_token_id
    with pytest.raises(ValueError, match="set data.vocab_extra_ids"):
        T5Dataset(ix, (0, 10), 64, build_tokenizer(Data(tokenizer_model=str(model))))
